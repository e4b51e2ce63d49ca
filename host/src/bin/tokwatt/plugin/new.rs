//! `tokwatt plugin new NAME`: scaffold a policy crate that builds and passes its own
//! tests at once. The files are templates under `host/templates/policy-rust/`, embedded
//! in the binary.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The templates, in the order they are written: (path in the crate, text).
const TEMPLATES: [(&str, &str); 5] = [
    (
        "Cargo.toml",
        include_str!("../../../../templates/policy-rust/Cargo.toml.tmpl"),
    ),
    (
        "src/lib.rs",
        include_str!("../../../../templates/policy-rust/lib.rs.tmpl"),
    ),
    (
        "{{name}}.toml",
        include_str!("../../../../templates/policy-rust/spec.toml.tmpl"),
    ),
    (
        "README.md",
        include_str!("../../../../templates/policy-rust/README.md.tmpl"),
    ),
    (
        ".gitignore",
        include_str!("../../../../templates/policy-rust/gitignore.tmpl"),
    ),
];

/// The SDK's package name, checked in `--sdk`'s manifest.
const SDK_PACKAGE: &str = "tokwatt-policy-sdk";

/// Names cargo refuses for a package, besides Rust keywords.
const RESERVED_NAMES: [&str; 9] = [
    "std",
    "core",
    "alloc",
    "proc_macro",
    "test",
    "deps",
    "examples",
    "build",
    "incremental",
];

/// Rust's keywords, strict and reserved (2024 edition).
const KEYWORDS: [&str; 52] = [
    "as", "async", "await", "break", "const", "continue", "crate", "dyn", "else", "enum", "extern",
    "false", "fn", "for", "gen", "if", "impl", "in", "let", "loop", "match", "mod", "move", "mut",
    "pub", "ref", "return", "self", "Self", "static", "struct", "super", "trait", "true", "type",
    "unsafe", "use", "where", "while", "abstract", "become", "box", "do", "final", "macro",
    "override", "priv", "typeof", "unsized", "virtual", "yield", "try",
];

/// The language of the scaffold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    Js,
}

#[derive(Debug, clap::Args)]
pub struct NewArgs {
    /// The policy's name: also its crate's name and its spec's (`NAME.toml`). Letters,
    /// digits, `-` and `_`, starting with a letter.
    name: String,
    /// The plugin's language (only Rust for now).
    #[arg(long, value_enum, default_value_t = Lang::Rust)]
    lang: Lang,
    /// Where to create the crate (default: ./NAME). Must be absent or empty.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The SDK crate (`plugins/sdk` of a tokwatt checkout; default: the one this
    /// tokwatt was built from).
    #[arg(long)]
    sdk: Option<PathBuf>,
}

pub fn new(args: &NewArgs) -> Result<()> {
    match args.lang {
        Lang::Rust => {}
        Lang::Python => bail!(
            "Python policies are not scaffolded yet: they come with the componentize-py \
             toolchain (`tokwatt plugin new --lang python` is planned). Write the policy in \
             Rust for now: `tokwatt plugin new {} --lang rust`",
            args.name
        ),
        Lang::Js => bail!(
            "JavaScript policies are not scaffolded yet: they come with the \
             componentize-js/jco toolchain (`tokwatt plugin new --lang js` is planned). \
             Write the policy in Rust for now: `tokwatt plugin new {} --lang rust`",
            args.name
        ),
    }
    check_crate_name(&args.name)?;
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(&args.name));
    check_destination(&dir)?;
    let sdk = sdk_dir(args.sdk.as_deref())?;
    let files = render(&args.name, &sdk)?;
    write_all(&dir, &files)?;
    let spec = format!("{}.toml", args.name);
    println!(
        "created {} (policy `{}`, Rust, SDK {})\n\nnext:\n  cd {}\n  rustup target add wasm32-wasip2   # once\n  cargo test\n  cargo build --release --target wasm32-wasip2\n  tokwatt check {spec}\n  tokwatt plugin test {spec}",
        dir.display(),
        args.name,
        sdk.display(),
        dir.display(),
    );
    Ok(())
}

/// Cargo's rules for a package name, with the fix in the error.
fn check_crate_name(name: &str) -> Result<()> {
    let problem = if name.is_empty() {
        Some("is empty".to_owned())
    } else if !name.starts_with(|c: char| c.is_ascii_alphabetic()) {
        Some("must start with a letter".to_owned())
    } else if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
    {
        Some(format!(
            "contains {bad:?}: use only letters, digits, `-` and `_`"
        ))
    } else if name.len() > 64 {
        Some("is longer than 64 characters".to_owned())
    } else if KEYWORDS.contains(&name) || RESERVED_NAMES.contains(&name.replace('-', "_").as_str())
    {
        Some("is a Rust keyword or a name cargo reserves".to_owned())
    } else {
        None
    };
    match problem {
        Some(problem) => bail!(
            "`{name}` is not a valid crate name: it {problem}. Choose a name like `my-policy`"
        ),
        None => Ok(()),
    }
}

/// The crate goes into a folder that is absent or empty, so nothing is overwritten.
fn check_destination(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    if !dir.is_dir() {
        bail!(
            "{} exists and is not a folder; choose another place with --dir",
            dir.display()
        );
    }
    let mut entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?;
    if entries.next().is_some() {
        bail!(
            "{} already exists and is not empty; choose another place with --dir, or remove it",
            dir.display()
        );
    }
    Ok(())
}

/// The SDK crate: `--sdk`, or `plugins/sdk` of the checkout this binary was built from.
fn sdk_dir(given: Option<&Path>) -> Result<PathBuf> {
    let (dir, origin) = match given {
        Some(dir) => (dir.to_owned(), "--sdk"),
        None => (
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/sdk"),
            "the checkout this tokwatt was built from",
        ),
    };
    let manifest = dir.join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).map_err(|error| {
        anyhow::anyhow!(
            "no SDK crate at {} ({origin}): cannot read {}: {error}. Pass --sdk with the \
             path of `plugins/sdk` in a tokwatt checkout",
            dir.display(),
            manifest.display()
        )
    })?;
    let names_sdk = toml::from_str::<toml::Table>(&text)
        .ok()
        .and_then(|table| {
            table
                .get("package")
                .and_then(|package| package.get("name"))
                .and_then(toml::Value::as_str)
                .map(|name| name == SDK_PACKAGE)
        })
        .unwrap_or(false);
    if !names_sdk {
        bail!(
            "{} is not the {SDK_PACKAGE} crate ({origin}); pass --sdk with the path of \
             `plugins/sdk` in a tokwatt checkout",
            manifest.display()
        );
    }
    // An absolute path, so the scaffold builds wherever it is moved to on this machine.
    dir.canonicalize()
        .with_context(|| format!("resolving the SDK path {}", dir.display()))
}

/// The crate's files: (path relative to the crate, text).
fn render(name: &str, sdk: &Path) -> Result<Vec<(String, String)>> {
    let crate_name = name.to_owned();
    let wasm = format!("{}.wasm", name.replace('-', "_"));
    let sdk_text = sdk.to_str().with_context(|| {
        format!(
            "the SDK path {} is not UTF-8, which Cargo.toml cannot hold; pass --sdk with another path",
            sdk.display()
        )
    })?;
    let sdk_path = toml::Value::String(sdk_text.to_owned()).to_string();
    let replacements = [
        ("{{name}}", name.to_owned()),
        ("{{crate}}", crate_name),
        ("{{wasm}}", wasm),
        ("{{Struct}}", struct_name(name)),
        ("{{sdk_path}}", sdk_path),
        ("{{sdk_display}}", sdk_text.to_owned()),
    ];
    let fill = |text: &str| {
        replacements
            .iter()
            .fold(text.to_owned(), |text, (key, value)| {
                text.replace(key, value)
            })
    };
    Ok(TEMPLATES
        .iter()
        .map(|(path, text)| (fill(path), fill(text)))
        .collect())
}

/// `my-cap_policy` → `MyCapPolicy`.
fn struct_name(name: &str) -> String {
    name.split(['-', '_'])
        .filter(|part| !part.is_empty())
        .map(|part| {
            let mut chars = part.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect()
}

/// Writes every file; on a failure, removes what it made, so a failed scaffold leaves
/// nothing behind.
fn write_all(dir: &Path, files: &[(String, String)]) -> Result<()> {
    let existed = dir.exists();
    let result = files.iter().try_for_each(|(path, text)| {
        let path = dir.join(path);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    });
    if result.is_err() {
        if existed {
            for (path, _) in files {
                let _ = std::fs::remove_file(dir.join(path));
            }
            let _ = std::fs::remove_dir(dir.join("src"));
        } else {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crate_names_follow_cargo() {
        for good in ["my-policy", "cap_batch", "p2"] {
            assert!(check_crate_name(good).is_ok(), "{good}");
        }
        for (bad, why) in [
            ("", "is empty"),
            ("2fast", "start with a letter"),
            ("my policy", "contains ' '"),
            ("my.policy", "contains '.'"),
            ("fn", "keyword"),
            ("test", "reserves"),
        ] {
            let error = check_crate_name(bad).expect_err(bad).to_string();
            assert!(
                error.contains(why) && error.contains("my-policy"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn struct_names_are_camel_case() {
        assert_eq!(struct_name("my-cap_policy"), "MyCapPolicy");
        assert_eq!(struct_name("p2"), "P2");
    }

    #[test]
    fn every_placeholder_is_filled() {
        let files = render("my-policy", Path::new("/opt/tokwatt/plugins/sdk")).expect("render");
        let names: Vec<&str> = files.iter().map(|(path, _)| path.as_str()).collect();
        assert!(names.contains(&"my-policy.toml"), "{names:?}");
        for (path, text) in &files {
            assert!(!text.contains("{{"), "{path} keeps a placeholder");
        }
        let manifest = &files[0].1;
        assert!(
            manifest.contains("path = \"/opt/tokwatt/plugins/sdk\""),
            "{manifest}"
        );
        let spec = files.iter().find(|(path, _)| path == "my-policy.toml");
        assert!(spec.is_some_and(|(_, text)| text.contains("release/my_policy.wasm")));
    }
}
