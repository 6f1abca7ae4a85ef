//! Extracts every ```rust block of the README into `$OUT_DIR/blocks.rs`:
//! one `async fn` per block, its body the block's text unchanged, after the
//! `let`s of `src/prelude.rs.in`, which bind the names the README's prose
//! assumes (`client`, `conn`, `queue`, `locker`, `order`, ...). They are
//! pasted, not a macro: a macro's `let`s would be hidden from the block by
//! hygiene.
//!
//! A block that needs a name bound otherwise says so in an HTML comment on
//! the line before it, which GitHub and rustdoc do not show:
//! `<!-- readme-test: let queue: Queue<Call> = any(); -->`.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    println!("cargo:rerun-if-changed={}", readme.display());
    let prelude = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/prelude.rs.in");
    println!("cargo:rerun-if-changed={}", prelude.display());
    let text = std::fs::read_to_string(&readme).expect("reading ../README.md");
    let prelude = std::fs::read_to_string(&prelude).expect("reading src/prelude.rs.in");
    let out = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("blocks.rs");
    std::fs::write(out, generate(&text, &prelude)).expect("writing blocks.rs");
}

/// One ```rust block: the README line its code starts on, the setup its
/// HTML comment asks for, and its code.
struct Block {
    line: usize,
    setup: String,
    code: String,
}

/// The blocks of `text`, in order.
fn blocks(text: &str) -> Vec<Block> {
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
    assert!(current.is_none(), "README.md ends inside a ```rust block");
    blocks
}

fn empty() -> Block {
    Block {
        line: 0,
        setup: String::new(),
        code: String::new(),
    }
}

/// The Rust source: a function per block, and their README lines.
fn generate(text: &str, prelude: &str) -> String {
    let blocks = blocks(text);
    let mut out = String::new();
    for block in &blocks {
        let line = block.line;
        // `let _ = { .. };`: a block may end with an expression of any type.
        let _ = write!(
            out,
            "/// README.md, the block from line {line}.\n\
             async fn readme_line_{line}() -> Result<(), BoxError> {{\n\
             {prelude}\n\
             {setup}\n\
             let _ = {{\n\
             // README.md line {line}\n\
             {code}\
             }};\n\
             Ok(())\n\
             }}\n\n",
            setup = block.setup,
            code = block.code,
        );
    }
    let lines: Vec<String> = blocks.iter().map(|b| b.line.to_string()).collect();
    let _ = writeln!(
        out,
        "/// The README line each compiled block starts on.\n\
         pub(crate) const BLOCK_LINES: &[usize] = &[{}];",
        lines.join(", ")
    );
    out
}
