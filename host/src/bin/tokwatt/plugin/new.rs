//! `tokwatt plugin new NAME [--lang rust|python|js]`: scaffold a policy that builds and
//! passes its own tests at once. The Rust files are templates under
//! `host/templates/policy-rust/`; the Python and JavaScript scaffolds are the shipped
//! examples (`examples/python/`, `examples/js/`) themselves, embedded, so the two cannot
//! drift, with the files that carry the name templated under `host/templates/`. All are
//! embedded in the binary.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// A file of a scaffold: its path in the folder (`{{name}}` is filled in) and its text.
type Template = (&'static str, &'static str);

/// The Rust templates, in the order they are written.
const RUST_TEMPLATES: [Template; 5] = [
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

/// The contract, copied into a Python or JavaScript scaffold so that it builds on its own
/// (a Rust scaffold has it through the SDK).
const CONTRACT: Template = (
    "wit/policy.wit",
    include_str!("../../../../../wit/policy.wit"),
);

/// The Python scaffold: the example's modules, and templates for what names the policy.
const PYTHON_FILES: [Template; 5] = [
    (
        "app.py",
        include_str!("../../../../../examples/python/app.py"),
    ),
    (
        "rules.py",
        include_str!("../../../../../examples/python/rules.py"),
    ),
    (
        "test_rules.py",
        include_str!("../../../../../examples/python/test_rules.py"),
    ),
    (
        "README.md",
        include_str!("../../../../templates/policy-python/README.md.tmpl"),
    ),
    (
        ".gitignore",
        include_str!("../../../../templates/policy-python/gitignore.tmpl"),
    ),
];

/// The JavaScript scaffold: the example's modules, and templates for what names the
/// policy.
const JS_FILES: [Template; 6] = [
    (
        "policy.js",
        include_str!("../../../../../examples/js/policy.js"),
    ),
    (
        "rules.js",
        include_str!("../../../../../examples/js/rules.js"),
    ),
    (
        "rules.test.js",
        include_str!("../../../../../examples/js/rules.test.js"),
    ),
    (
        "package.json",
        include_str!("../../../../templates/policy-js/package.json.tmpl"),
    ),
    (
        "README.md",
        include_str!("../../../../templates/policy-js/README.md.tmpl"),
    ),
    (
        ".gitignore",
        include_str!("../../../../templates/policy-js/gitignore.tmpl"),
    ),
];

/// The examples' specs, from which the scaffolds' `NAME.toml` are made.
const PYTHON_SPEC: &str = include_str!("../../../../../examples/python/policy.toml");
const JS_SPEC: &str = include_str!("../../../../../examples/js/policy.toml");

/// The example's own words in its spec, and what the scaffold says instead (`{{name}}`
/// is filled in). A unit test checks that each is still there to replace.
const PYTHON_SPEC_WORDS: [(&str, &str); 2] = [
    (
        "The spec of the example Python policy (app.py)",
        "The spec of the policy {{name}} (app.py)",
    ),
    ("examples/python/policy.toml", "{{name}}.toml"),
];
const JS_SPEC_WORDS: [(&str, &str); 2] = [
    (
        "The spec of the example JavaScript policy (policy.js)",
        "The spec of the policy {{name}} (policy.js)",
    ),
    ("examples/js/policy.toml", "{{name}}.toml"),
];

/// The contract's folder as the examples name it (from `examples/LANG/`), and as a
/// scaffold does (its own copy).
const EXAMPLE_WIT: &str = "../../wit";
const SCAFFOLD_WIT: &str = "wit";

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
    /// A crate on the SDK, built by cargo for wasm32-wasip2.
    Rust,
    /// Python modules, built by componentize-py.
    Python,
    /// JavaScript modules, built by componentize-js (an npm package).
    Js,
}

impl Lang {
    fn label(self) -> &'static str {
        match self {
            Lang::Rust => "Rust",
            Lang::Python => "Python",
            Lang::Js => "JavaScript",
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct NewArgs {
    /// The policy's name, and its spec's (`NAME.toml`); a Rust policy's crate and a
    /// JavaScript policy's npm package take it too. Letters, digits, `-` and `_`, starting
    /// with a letter (no uppercase for JavaScript: npm refuses it).
    name: String,
    /// The plugin's language: rust (a crate on the SDK), python (componentize-py) or js
    /// (componentize-js).
    #[arg(long, value_enum, default_value_t = Lang::Rust)]
    lang: Lang,
    /// Where to create the policy (default: ./NAME). Must be absent or empty.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Rust only: the SDK crate (`plugins/sdk` of a tokwatt checkout; default: the one
    /// this tokwatt was built from).
    #[arg(long)]
    sdk: Option<PathBuf>,
}

pub fn new(args: &NewArgs) -> Result<()> {
    if args.sdk.is_some() && args.lang != Lang::Rust {
        bail!(
            "--sdk names the Rust SDK crate, which a {} policy does not use; drop --sdk, \
             or scaffold a Rust policy with --lang rust",
            args.lang.label()
        );
    }
    check_name(&args.name, args.lang)?;
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(&args.name));
    check_destination(&dir)?;
    let spec = format!("{}.toml", args.name);
    let (files, toolchain, next) = match args.lang {
        Lang::Rust => {
            let sdk = sdk_dir(args.sdk.as_deref())?;
            let next = vec![
                "rustup target add wasm32-wasip2   # once".to_owned(),
                "cargo test".to_owned(),
                "cargo build --release --target wasm32-wasip2".to_owned(),
            ];
            (
                render(&args.name, &sdk)?,
                format!("SDK {}", sdk.display()),
                next,
            )
        }
        Lang::Python => {
            let next = vec![
                "python3 -m unittest".to_owned(),
                "python3 -m pip install --user componentize-py==0.25.1   # once".to_owned(),
                "componentize-py -d wit -w policy componentize app -o policy.wasm".to_owned(),
            ];
            (
                render_python(&args.name),
                "componentize-py".to_owned(),
                next,
            )
        }
        Lang::Js => {
            let next = vec![
                "npm ci   # componentize-js, pinned by package-lock.json".to_owned(),
                "npm test".to_owned(),
                "npm run build".to_owned(),
            ];
            (render_js(&args.name), "componentize-js".to_owned(), next)
        }
    };
    write_all(&dir, &files)?;
    let mut next = next;
    if args.lang != Lang::Rust {
        // A componentized interpreter takes seconds to compile: do it once, ahead.
        next.push("tokwatt plugin compile policy.wasm".to_owned());
        next.push("tokwatt plugin check policy.wasm".to_owned());
    }
    next.push(format!("tokwatt check {spec}"));
    next.push(format!("tokwatt plugin test {spec}"));
    let next: String = next.iter().map(|line| format!("\n  {line}")).collect();
    println!(
        "created {} (policy `{}`, {}, {toolchain})\n\nnext:\n  cd {}{next}",
        dir.display(),
        args.name,
        args.lang.label(),
        dir.display(),
    );
    Ok(())
}

/// The rules every language shares (a valid policy name), then the language's own:
/// cargo's for a crate, npm's for a package. The error names the fix.
fn check_name(name: &str, lang: Lang) -> Result<()> {
    let shared = if name.is_empty() {
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
    } else {
        None
    };
    let mut suggestion = "my-policy".to_owned();
    let (what, problem) = match lang {
        Lang::Rust => (
            "crate name",
            shared.or_else(|| {
                (KEYWORDS.contains(&name)
                    || RESERVED_NAMES.contains(&name.replace('-', "_").as_str()))
                .then(|| "is a Rust keyword or a name cargo reserves".to_owned())
            }),
        ),
        // The Python module is always `app`, so the name is only the spec's.
        Lang::Python => ("policy name", shared),
        Lang::Js => (
            "name for a JavaScript policy (package.json's `name`)",
            shared.or_else(|| {
                if name.chars().any(|c| c.is_ascii_uppercase()) {
                    suggestion = name.to_ascii_lowercase();
                    Some("has uppercase letters, which npm refuses in a package name".to_owned())
                } else if name == "node_modules" {
                    Some("is a name npm reserves".to_owned())
                } else {
                    None
                }
            }),
        ),
    };
    match problem {
        Some(problem) => {
            bail!("`{name}` is not a valid {what}: it {problem}. Choose a name like `{suggestion}`")
        }
        None => Ok(()),
    }
}

/// The policy goes into a folder that is absent or empty, so nothing is overwritten.
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

/// The Rust crate's files: (path relative to the crate, text).
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
    Ok(RUST_TEMPLATES
        .iter()
        .map(|(path, text)| (fill(path), fill(text)))
        .collect())
}

/// The Python scaffold's files: (path relative to its folder, text).
fn render_python(name: &str) -> Vec<(String, String)> {
    render_from_example(name, &PYTHON_FILES, PYTHON_SPEC, &PYTHON_SPEC_WORDS)
}

/// The JavaScript scaffold's files: (path relative to its folder, text).
fn render_js(name: &str) -> Vec<(String, String)> {
    let mut files = render_from_example(name, &JS_FILES, JS_SPEC, &JS_SPEC_WORDS);
    files.push(("package-lock.json".to_owned(), js_lockfile(name)));
    files
}

/// The example's npm lockfile under the policy's name. The scaffold's `package.json`
/// asks for the example's dependencies (a unit test holds them equal), so `npm ci`
/// installs exactly the tool versions the example was built and measured with, and
/// needs nothing but the tarballs (npm's cache can serve them offline).
const JS_LOCKFILE: &str = include_str!("../../../../../examples/js/package-lock.json");
const JS_EXAMPLE_PACKAGE_NAME: &str = "\"name\": \"tokwatt-policy-js-example\"";

fn js_lockfile(name: &str) -> String {
    // A textual edit keeps npm's own layout and key order; the name is a valid npm name
    // (checked before), and JSON-quoted all the same.
    let quoted = serde_json::Value::String(name.to_owned()).to_string();
    JS_LOCKFILE.replace(JS_EXAMPLE_PACKAGE_NAME, &format!("\"name\": {quoted}"))
}

/// A scaffold made from an example: its files with the name filled in and the contract
/// taken from the scaffold's own `wit/`, the contract itself, and `NAME.toml`, the
/// example's spec under the policy's name.
fn render_from_example(
    name: &str,
    files: &[Template],
    example_spec: &str,
    spec_words: &[(&str, &str)],
) -> Vec<(String, String)> {
    let fill = |text: &str| {
        text.replace(EXAMPLE_WIT, SCAFFOLD_WIT)
            .replace("{{name}}", name)
    };
    let mut rendered: Vec<(String, String)> = files
        .iter()
        .chain([&CONTRACT])
        .map(|(path, text)| (fill(path), fill(text)))
        .collect();
    rendered.push((
        format!("{name}.toml"),
        spec_from_example(example_spec, name, spec_words),
    ));
    rendered
}

/// The example's spec, comments kept, with the policy's name in its `name` key and in
/// place of the example's own words.
fn spec_from_example(example: &str, name: &str, words: &[(&str, &str)]) -> String {
    let name_value = toml::Value::String(name.to_owned()).to_string();
    let mut named = false;
    let text: String = example
        .split_inclusive('\n')
        .map(|line| {
            if !named && line.starts_with("name = ") {
                named = true;
                let ending = if line.ends_with('\n') { "\n" } else { "" };
                format!("name = {name_value}{ending}")
            } else {
                line.to_owned()
            }
        })
        .collect();
    words
        .iter()
        .fold(text, |text, (example_words, scaffold_words)| {
            text.replace(example_words, &scaffold_words.replace("{{name}}", name))
        })
        .replace(EXAMPLE_WIT, SCAFFOLD_WIT)
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
            // The folders the files went into (`src`, `wit`), deepest first; a folder
            // that is not empty stays.
            let mut folders: Vec<&Path> = files
                .iter()
                .flat_map(|(path, _)| Path::new(path).ancestors().skip(1))
                .filter(|folder| !folder.as_os_str().is_empty())
                .collect();
            folders.sort_by_key(|folder| std::cmp::Reverse(folder.components().count()));
            folders.dedup();
            for folder in folders {
                let _ = std::fs::remove_dir(dir.join(folder));
            }
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
            assert!(check_name(good, Lang::Rust).is_ok(), "{good}");
        }
        for (bad, why) in [
            ("", "is empty"),
            ("2fast", "start with a letter"),
            ("my policy", "contains ' '"),
            ("my.policy", "contains '.'"),
            ("fn", "keyword"),
            ("test", "reserves"),
        ] {
            let error = check_name(bad, Lang::Rust).expect_err(bad).to_string();
            assert!(
                error.contains(why) && error.contains("my-policy"),
                "{bad}: {error}"
            );
        }
    }

    #[test]
    fn python_and_javascript_names_follow_their_own_rules() {
        // Rust's keywords mean nothing to them.
        for good in ["my-policy", "fn", "test", "p2"] {
            assert!(check_name(good, Lang::Python).is_ok(), "{good}");
            assert!(check_name(good, Lang::Js).is_ok(), "{good}");
        }
        assert!(check_name("MyPolicy", Lang::Python).is_ok());
        for lang in [Lang::Python, Lang::Js] {
            for (bad, why) in [
                ("2fast", "start with a letter"),
                ("my policy", "contains ' '"),
            ] {
                let error = check_name(bad, lang).expect_err(bad).to_string();
                assert!(
                    error.contains(why) && error.contains("my-policy"),
                    "{bad}: {error}"
                );
            }
        }
        let error = check_name("MyPolicy", Lang::Js)
            .expect_err("npm refuses uppercase")
            .to_string();
        assert!(
            error.contains("uppercase") && error.contains("`mypolicy`"),
            "{error}"
        );
        let error = check_name("node_modules", Lang::Js)
            .expect_err("npm reserves it")
            .to_string();
        assert!(error.contains("npm reserves"), "{error}");
    }

    #[test]
    fn struct_names_are_camel_case() {
        assert_eq!(struct_name("my-cap_policy"), "MyCapPolicy");
        assert_eq!(struct_name("p2"), "P2");
    }

    /// A `{{word}}` left in the text.
    fn placeholder(text: &str) -> Option<&str> {
        text.match_indices("{{").find_map(|(start, _)| {
            let rest = &text[start + 2..];
            let end = rest.find("}}")?;
            let word = &rest[..end];
            (!word.is_empty() && word.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
                .then_some(word)
        })
    }

    #[test]
    fn every_placeholder_is_filled() {
        let files = render("my-policy", Path::new("/opt/tokwatt/plugins/sdk")).expect("render");
        let names: Vec<&str> = files.iter().map(|(path, _)| path.as_str()).collect();
        assert!(names.contains(&"my-policy.toml"), "{names:?}");
        for (path, text) in files
            .iter()
            .chain(&render_python("my-policy"))
            .chain(&render_js("my-policy"))
        {
            assert_eq!(placeholder(text), None, "{path} keeps a placeholder");
        }
        let manifest = &files[0].1;
        assert!(
            manifest.contains("path = \"/opt/tokwatt/plugins/sdk\""),
            "{manifest}"
        );
        let spec = files.iter().find(|(path, _)| path == "my-policy.toml");
        assert!(spec.is_some_and(|(_, text)| text.contains("release/my_policy.wasm")));
    }

    fn file<'a>(files: &'a [(String, String)], path: &str) -> &'a str {
        files
            .iter()
            .find(|(name, _)| name == path)
            .map(|(_, text)| text.as_str())
            .unwrap_or_else(|| panic!("no {path} in the scaffold"))
    }

    #[test]
    fn python_and_javascript_scaffolds_are_the_examples_standing_alone() {
        for (lang, files, sources, words) in [
            (
                "python",
                render_python("my-policy"),
                &PYTHON_FILES[..3],
                &PYTHON_SPEC_WORDS,
            ),
            ("js", render_js("my-policy"), &JS_FILES[..3], &JS_SPEC_WORDS),
        ] {
            // The example's modules, as shipped but for where the contract is.
            for (path, example) in sources {
                assert_eq!(
                    file(&files, path),
                    example.replace(EXAMPLE_WIT, SCAFFOLD_WIT),
                    "{lang}: {path}"
                );
            }
            assert_eq!(file(&files, "wit/policy.wit"), CONTRACT.1);
            for (path, text) in &files {
                assert!(
                    !text.contains("../") && !text.contains("examples/"),
                    "{lang}: {path} points outside the scaffold"
                );
            }
            // The example's spec under the new name, each of its words replaced.
            let example = if lang == "python" {
                PYTHON_SPEC
            } else {
                JS_SPEC
            };
            for (example_words, _) in words {
                assert!(
                    example.contains(example_words),
                    "examples/{lang}/policy.toml no longer says {example_words:?}: update the scaffold's words"
                );
            }
            let spec = file(&files, "my-policy.toml");
            assert!(spec.contains("policy my-policy (") && spec.contains("[sandbox]"));
            let table: toml::Table = toml::from_str(spec)
                .unwrap_or_else(|error| panic!("{lang}: the spec is not TOML: {error}\n{spec}"));
            assert_eq!(table["name"].as_str(), Some("my-policy"));
            assert_eq!(table["plugin"].as_str(), Some("policy.wasm"));
            assert!(file(&files, ".gitignore").contains("/policy.wasm"));
            assert!(file(&files, "README.md").starts_with("# my-policy\n"));
        }
    }

    #[test]
    fn the_javascript_package_builds_against_its_own_contract_with_the_examples_tools() {
        let files = render_js("my-policy");
        let package: serde_json::Value =
            serde_json::from_str(file(&files, "package.json")).expect("package.json is JSON");
        let example: serde_json::Value =
            serde_json::from_str(include_str!("../../../../../examples/js/package.json"))
                .expect("the example's package.json is JSON");
        assert_eq!(package["name"], "my-policy");
        assert_eq!(package["devDependencies"], example["devDependencies"]);
        assert_eq!(package["type"], example["type"]);
        let example_build = example["scripts"]["build"]
            .as_str()
            .expect("the example's build script")
            .replace(EXAMPLE_WIT, SCAFFOLD_WIT);
        assert_eq!(package["scripts"]["build"], example_build.as_str());
        assert_eq!(package["scripts"]["test"], example["scripts"]["test"]);
        assert!(file(&files, ".gitignore").contains("/node_modules"));
        // The lockfile is the example's under the policy's name: both of its names moved.
        let lock: serde_json::Value = serde_json::from_str(file(&files, "package-lock.json"))
            .expect("package-lock.json is JSON");
        let example_lock: serde_json::Value =
            serde_json::from_str(JS_LOCKFILE).expect("the example's lockfile is JSON");
        assert_eq!(lock["name"], "my-policy");
        assert_eq!(lock["packages"][""]["name"], "my-policy");
        assert_eq!(lock["version"], package["version"]);
        assert_eq!(
            lock["packages"][""]["devDependencies"],
            package["devDependencies"]
        );
        assert_eq!(
            lock["packages"].as_object().map(|p| p.len()),
            example_lock["packages"].as_object().map(|p| p.len())
        );
    }
}
