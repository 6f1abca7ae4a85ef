//! Every ```rust block of lockgate's README and of its guides under `docs/`,
//! compiled by `cargo test`.
//!
//! The blocks are excerpts: they use names the prose introduces
//! (`client`, `conn`, `queue`, `locker`, an `Order` type, a `handle_order`
//! handler). The build script pastes each block, unchanged, into an `async
//! fn` of its own after `src/prelude.rs.in`, which binds those names; this
//! module declares the types and functions they refer to. The functions are
//! type-checked, never run (every value comes from `any()`), so a block
//! that no longer compiles against lockgate's API fails the build, and the
//! error names its file and line (`// docs/layer.md line 23`). Blocks are
//! checked, not run: what they do is the business of the tests beside the
//! features they show.
#![forbid(unsafe_code)]

#[cfg(test)]
mod blocks {
    // README excerpts bind names they do not all use, and read as prose,
    // not as lint-clean code.
    #![allow(
        unused,
        dead_code,
        unreachable_code,
        non_upper_case_globals,
        clippy::all
    )]

    use std::time::{Duration, SystemTime};

    use lockgate::layer::DeferDelay;
    use lockgate::{
        Acquisition, Backoff, BoxError, HeldLock, Job, LockLayer, Locker, OnConflict, Outcome,
        Permits, PushOptions, Queue, ReleaseListener, Worker,
    };
    use redis::aio::ConnectionManager;
    use redis::cluster_async::ClusterConnection;
    use serde::{Deserialize, Serialize};
    use tower::ServiceBuilder;

    /// A value of any type, for code that is compiled and never run.
    fn any<T>() -> T {
        unreachable!("README and guide blocks are compiled, not run")
    }

    /// The README's message types.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct Order {
        pub(crate) id: u64,
        pub(crate) account: String,
    }

    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct Task {
        pub(crate) tenant: String,
        pub(crate) premium: bool,
    }

    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct Email {
        pub(crate) to: String,
    }

    #[derive(Debug, Clone, Serialize, Deserialize)]
    pub(crate) struct Call {
        pub(crate) account: String,
    }

    /// What the handlers of the README write to.
    pub(crate) struct Update;
    pub(crate) struct Account;
    pub(crate) struct Db;

    impl Db {
        async fn apply(&self, _: &Job<Order>, _fence: u64) -> Result<(), BoxError> {
            Ok(())
        }
    }

    /// The database of "Reading the lock in the handler".
    static db: Db = Db;

    async fn handle_order(_: Job<Order>) -> Result<(), BoxError> {
        Ok(())
    }

    async fn handle(_: &Job<Order>) -> Result<(), BoxError> {
        Ok(())
    }

    async fn call_upstream(_: Job<Call>) -> Result<(), BoxError> {
        Ok(())
    }

    async fn write_to_storage(_fence: u64) {}

    async fn store(_: &Update, _fence: u64) {}

    async fn add(_: &Account, _amount: i64) -> i64 {
        0
    }

    fn alert(_id: &str, _error: Option<&str>) {}

    include!(concat!(env!("OUT_DIR"), "/blocks.rs"));

    /// The extraction missed no block: as many compiled from each file as
    /// it has, the README's and every guide's under `docs/`.
    #[test]
    fn every_rust_block_of_the_readme_is_compiled() {
        let readme = include_str!("../../README.md");
        assert!(
            readme.lines().any(|l| l.starts_with("```rust")),
            "the README has no ```rust block"
        );
        assert_eq!(SOURCES[0].0, "README.md");
        assert!(
            SOURCES[1..]
                .iter()
                .all(|(name, _)| name.starts_with("docs/")),
            "{:?}",
            SOURCES.iter().map(|(name, _)| name).collect::<Vec<_>>()
        );
        let guides = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs"))
            .expect("reading docs/")
            .filter(|entry| {
                let path = entry.as_ref().expect("reading docs/").path();
                path.extension().is_some_and(|ext| ext == "md")
            })
            .count();
        assert_eq!(SOURCES.len(), 1 + guides, "every guide is read");
        for (name, text) in SOURCES {
            let found = text.lines().filter(|l| l.starts_with("```rust")).count();
            let compiled = BLOCK_LINES.iter().filter(|(file, _)| file == name).count();
            assert_eq!(compiled, found, "{name}: blocks at {BLOCK_LINES:?}");
        }
    }
}

#[cfg(test)]
mod dependencies {
    /// The version requirement of `name` in a `[dependencies]` table's text
    /// (`name = "x"` or `name = { version = "x", .. }`).
    fn requirement<'a>(toml: &'a str, name: &str) -> Option<&'a str> {
        let line = toml
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} =")))?;
        let (_, rest) = line.split_once('=')?;
        let rest = match rest.split_once("version") {
            Some((_, after)) => after.split_once('=')?.1,
            None => rest,
        };
        rest.split('"').nth(1)
    }

    /// The README's dependency lines name the `redis` version lockgate is
    /// built with (issue 39: a mismatched major version gives two `redis`
    /// crates and baffling `ConnectionManager` type errors).
    #[test]
    fn the_readme_names_the_redis_version_lockgate_uses() {
        let readme = include_str!("../../README.md");
        let manifest = include_str!("../../Cargo.toml");
        let toml = readme
            .split("```toml")
            .nth(1)
            .and_then(|rest| rest.split("```").next())
            .expect("the README's first ```toml block: the dependency lines");
        let ours = requirement(manifest, "redis").expect("lockgate's redis dependency");
        assert_eq!(requirement(toml, "redis"), Some(ours), "{toml}");
        let lockgate = requirement(toml, "lockgate").expect("the lockgate line");
        let package = manifest
            .lines()
            .find(|l| l.starts_with("version ="))
            .and_then(|l| l.split('"').nth(1))
            .expect("lockgate's version");
        assert!(
            package.starts_with(lockgate),
            "README: {lockgate}, Cargo.toml: {package}"
        );
    }
}

#[cfg(test)]
mod links {
    //! Every relative link of the README and the guides reaches a file
    //! that exists, and every `#anchor` a heading (or an `<a id>`) of it:
    //! moving a section between files must not leave a reader at a dead
    //! link.

    use std::collections::HashSet;
    use std::path::{Path, PathBuf};

    /// The lines outside fenced code blocks (fences and code blanked),
    /// with inline code blanked too.
    fn prose(text: &str) -> Vec<String> {
        let mut fence: Option<&str> = None;
        let mut lines = Vec::new();
        for line in text.lines() {
            let trimmed = line.trim_start();
            let opens = ["```", "~~~"].into_iter().find(|f| trimmed.starts_with(f));
            match (fence, opens) {
                (None, Some(f)) => {
                    fence = Some(f);
                    lines.push(String::new());
                }
                (Some(f), _) => {
                    if trimmed.starts_with(f) {
                        fence = None;
                    }
                    lines.push(String::new());
                }
                (None, None) => lines.push(blank_inline_code(line)),
            }
        }
        lines
    }

    fn blank_inline_code(line: &str) -> String {
        let mut inside = false;
        line.chars()
            .map(|c| {
                if c == '`' {
                    inside = !inside;
                    ' '
                } else if inside {
                    ' '
                } else {
                    c
                }
            })
            .collect()
    }

    /// GitHub's anchor of a heading: lowercased, links reduced to their
    /// text, HTML tags and punctuation other than `-` and `_` dropped,
    /// spaces turned into `-`.
    fn slug(heading: &str) -> String {
        let mut text = String::new();
        let mut chars = heading.trim().chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '<' => {
                    for c in chars.by_ref() {
                        if c == '>' {
                            break;
                        }
                    }
                }
                ']' if chars.peek() == Some(&'(') => {
                    for c in chars.by_ref() {
                        if c == ')' {
                            break;
                        }
                    }
                }
                c => text.push(c),
            }
        }
        let kept = text.to_lowercase();
        kept.chars()
            .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
            .map(|c| if c == ' ' { '-' } else { c })
            .collect()
    }

    /// The anchors of a markdown file: its headings' (repeats numbered
    /// `-1`, `-2`, ...) and its `<a id="...">`s.
    fn anchors(text: &str) -> HashSet<String> {
        let mut found = HashSet::new();
        let mut seen = std::collections::HashMap::<String, usize>::new();
        for line in prose(text) {
            let hashes = line.chars().take_while(|c| *c == '#').count();
            if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') {
                let s = slug(line[hashes..].trim_end_matches('#'));
                let n = seen.entry(s.clone()).or_default();
                found.insert(if *n == 0 {
                    s.clone()
                } else {
                    format!("{s}-{n}")
                });
                *n += 1;
            }
            for tag in ["<a id=\"", "<a name=\""] {
                for (at, _) in line.match_indices(tag) {
                    let rest = &line[at + tag.len()..];
                    if let Some((id, _)) = rest.split_once('"') {
                        found.insert(id.to_owned());
                    }
                }
            }
        }
        found
    }

    /// The targets of the inline links of `line`: `[text](target)`.
    fn targets(line: &str) -> Vec<String> {
        let mut found = Vec::new();
        for (at, _) in line.match_indices("](") {
            let rest = &line[at + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = rest[..end].trim().trim_start_matches('<');
            let target = target.split_whitespace().next().unwrap_or("");
            found.push(target.trim_end_matches('>').to_owned());
        }
        found
    }

    #[test]
    fn every_relative_link_of_the_readme_and_the_guides_resolves() {
        let root = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        let mut files = vec![root.join("README.md")];
        let mut guides: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
            .expect("reading docs/")
            .map(|entry| entry.expect("reading docs/").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
            .collect();
        guides.sort();
        files.extend(guides);
        let read = |path: &Path| std::fs::read_to_string(path).expect("reading a markdown file");
        let (mut broken, mut checked) = (Vec::new(), 0);
        for file in &files {
            let text = read(file);
            for (n, line) in prose(&text).iter().enumerate() {
                for target in targets(line) {
                    let scheme = target.split_once(':').is_some_and(|(s, _)| {
                        !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '+')
                    });
                    if target.is_empty() || scheme {
                        continue;
                    }
                    checked += 1;
                    let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
                    let dest = match path {
                        "" => file.clone(),
                        path => file.parent().expect("a file's directory").join(path),
                    };
                    let name = file.strip_prefix(&root).unwrap_or(file).display();
                    let at = format!("{name}:{}: {target}", n + 1);
                    if !dest.exists() {
                        broken.push(format!("{at}: no such file"));
                    } else if !anchor.is_empty()
                        && (dest.extension().is_none_or(|ext| ext != "md")
                            || !anchors(&read(&dest)).contains(anchor))
                    {
                        broken.push(format!("{at}: no such heading"));
                    }
                }
            }
        }
        assert!(checked > 50, "only {checked} links found: the parser broke");
        assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    }
}
