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
