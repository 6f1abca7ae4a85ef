//! Extracts every ```rust block of the README and of the guides under
//! `docs/` (`../README.md`, then `../docs/*.md` sorted by name) into
//! `$OUT_DIR/blocks.rs`: one `async fn` per block, named after its file and
//! line (`readme_line_101`, `docs_layer_line_23`), its body the block's
//! text unchanged, after the `let`s of `src/prelude.rs.in`, which bind the
//! names the prose assumes (`client`, `conn`, `queue`, `locker`, `order`,
//! ...). They are pasted, not a macro: a macro's `let`s would be hidden from
//! the block by hygiene.
//!
//! A block that needs a name bound otherwise says so in an HTML comment on
//! the line before it, which GitHub and rustdoc do not show:
//! `<!-- readme-test: let queue: Queue<Call> = any(); -->`.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The markdown files whose blocks are compiled: the README, then every
/// `docs/*.md` by name, each with the name it goes by in the generated code.
fn sources(root: &Path) -> Vec<(String, PathBuf)> {
    let mut sources = vec![("README.md".to_owned(), root.join("README.md"))];
    let docs = root.join("docs");
    let mut guides: Vec<PathBuf> = std::fs::read_dir(&docs)
        .expect("reading ../docs")
        .map(|entry| entry.expect("reading ../docs").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    guides.sort();
    for path in guides {
        let name = path.file_name().expect("a file name").to_string_lossy();
        sources.push((format!("docs/{name}"), path));
    }
    sources
}

/// `README.md` → `readme`, `docs/keyed.md` → `docs_keyed`: the prefix of
/// the functions of a file's blocks.
fn stem(name: &str) -> String {
    let name = name.strip_suffix(".md").unwrap_or(name);
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect()
}

fn main() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest.join("..");
    println!("cargo:rerun-if-changed={}", root.join("docs").display());
    let prelude = manifest.join("src/prelude.rs.in");
    println!("cargo:rerun-if-changed={}", prelude.display());
    let prelude = std::fs::read_to_string(&prelude).expect("reading src/prelude.rs.in");
    let mut files = Vec::new();
    for (name, path) in sources(&root) {
        println!("cargo:rerun-if-changed={}", path.display());
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {name}: {e}"));
        files.push((name, path, text));
    }
    let out = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("blocks.rs");
    std::fs::write(out, generate(&files, &prelude)).expect("writing blocks.rs");
}

/// One ```rust block: the line of its file its code starts on, the setup
/// its HTML comment asks for, and its code.
struct Block {
    line: usize,
    setup: String,
    code: String,
}

/// The blocks of `text` (the file `name`), in order.
fn blocks(name: &str, text: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut current: Option<Block> = None;
    let mut previous = "";
    for (i, line) in text.lines().enumerate() {
        match &mut current {
            Some(block) if line.trim_start().starts_with("```") => {
                blocks.push(std::mem::replace(block, empty()));
                current = None;
            }
            Some(block) => {
                block.code.push_str(line);
                block.code.push('\n');
            }
            None if line.starts_with("```rust") => {
                let setup = previous
                    .trim()
                    .strip_prefix("<!-- readme-test:")
                    .and_then(|rest| rest.strip_suffix("-->"))
                    .unwrap_or_default();
                current = Some(Block {
                    line: i + 2,
                    setup: setup.trim().to_owned(),
                    code: String::new(),
                });
            }
            None => {}
        }
        previous = line;
    }
    assert!(current.is_none(), "{name} ends inside a ```rust block");
    blocks
}

fn empty() -> Block {
    Block {
        line: 0,
        setup: String::new(),
        code: String::new(),
    }
}

/// The Rust source: a function per block of every file; their files and
/// lines; and each file's text, for the test that counts the blocks.
fn generate(files: &[(String, PathBuf, String)], prelude: &str) -> String {
    let mut out = String::new();
    let mut names = BTreeSet::new();
    let mut places = Vec::new();
    for (name, _, text) in files {
        let stem = stem(name);
        for block in blocks(name, text) {
            let line = block.line;
            let function = format!("{stem}_line_{line}");
            assert!(
                names.insert(function.clone()),
                "two blocks make `{function}`"
            );
            // `let _ = { .. };`: a block may end with an expression of any type.
            let _ = write!(
                out,
                "/// {name}, the block from line {line}.\n\
                 async fn {function}() -> Result<(), BoxError> {{\n\
                 {prelude}\n\
                 {setup}\n\
                 let _ = {{\n\
                 // {name} line {line}\n\
                 {code}\
                 }};\n\
                 Ok(())\n\
                 }}\n\n",
                setup = block.setup,
                code = block.code,
            );
            places.push(format!("({name:?}, {line})"));
        }
    }
    let _ = writeln!(
        out,
        "/// The file and line each compiled block starts on.\n\
         pub(crate) const BLOCK_LINES: &[(&str, usize)] = &[{}];\n",
        places.join(", ")
    );
    let texts: Vec<String> = files
        .iter()
        .map(|(name, path, _)| {
            format!("({name:?}, include_str!({:?}))", path.display().to_string())
        })
        .collect();
    let _ = writeln!(
        out,
        "/// Every file whose blocks are compiled, with its text.\n\
         pub(crate) const SOURCES: &[(&str, &str)] = &[{}];",
        texts.join(", ")
    );
    out
}
