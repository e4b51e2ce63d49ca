//! `tokwatt completions SHELL` and `tokwatt man`: shell completions and man pages, made
//! from the same clap definition that parses the command line, so they never fall behind a
//! flag.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::CommandFactory as _;

#[derive(Debug, clap::Args)]
#[command(after_help = "Install, for example:
  bash: tokwatt completions bash > ~/.local/share/bash-completion/completions/tokwatt
  zsh:  tokwatt completions zsh > ~/.zfunc/_tokwatt   (with fpath+=(~/.zfunc) before compinit)
  fish: tokwatt completions fish > ~/.config/fish/completions/tokwatt.fish")]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(Debug, clap::Args)]
#[command(after_help = "Read it at once: tokwatt man | man -l -
Install every page: tokwatt man --out ~/.local/share/man/man1")]
pub struct ManArgs {
    /// Write tokwatt.1 and a page per subcommand (tokwatt-run.1, tokwatt-plugin-test.1, …)
    /// into this folder instead of printing tokwatt.1 on standard output.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

/// Prints the completion script for `args.shell` on standard output.
pub fn completions(args: &CompletionsArgs) -> Result<()> {
    let mut command = crate::Cli::command();
    let name = command.get_name().to_owned();
    clap_complete::generate(args.shell, &mut command, name, &mut std::io::stdout());
    Ok(())
}

/// Prints `tokwatt.1`, or writes every page into `--out`.
pub fn man(args: &ManArgs) -> Result<()> {
    let command = crate::Cli::command();
    match &args.out {
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(command)
                .render(&mut page)
                .context("rendering the man page")?;
            use std::io::Write as _;
            std::io::stdout()
                .write_all(&page)
                .context("writing the man page")?;
        }
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating the folder {}", dir.display()))?;
            let written = write_pages(command, dir)?;
            println!("wrote {written} man pages into {}", dir.display());
        }
    }
    Ok(())
}

/// Writes the page of `command` and of every subcommand under it, named by their path
/// (`tokwatt-plugin-test.1`); returns how many.
fn write_pages(mut command: clap::Command, dir: &Path) -> Result<usize> {
    // Built, every subcommand knows its path (`tokwatt plugin test`), which names its page.
    command.build();
    let mut written = 0;
    let mut pending = vec![command];
    while let Some(command) = pending.pop() {
        pending.extend(
            command
                .get_subcommands()
                .filter(|sub| !sub.is_hide_set() && sub.get_name() != "help")
                .cloned(),
        );
        let path = clap_mangen::Man::new(command)
            .generate_to(dir)
            .with_context(|| format!("writing a man page into {}", dir.display()))?;
        tracing::debug!(page = %path.display(), "wrote a man page");
        written += 1;
    }
    Ok(written)
}
