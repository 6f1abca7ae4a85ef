//! Per-key distributed locks on Redis, packaged as a tower middleware, with a
//! reliable Redis delay queue behind them.
//!
//! # Layout
//!
//! * [`lock`]: the [`Locker`], `SET NX PX` locks with token-checked release
//!   and renewal, fencing tokens issued on first use, and the
//!   [`ReleaseListener`] that wakes waiters when a lock is released.
//! * [`queue`]: the [`Queue`], a Redis delay queue with leases, retries and
//!   dead letters, and its [`Waiter`](queue::Waiter) for blocking wake-ups.
//! * [`layer`]: the [`LockLayer`] tower middleware and its [`OnConflict`]
//!   strategies (fail, retry with [`Backoff`] woken by the release, defer
//!   for a time or into the key's line until released), returning an [`Outcome`].
//! * [`worker`]: the [`Worker`], which drives a tower service from a queue:
//!   claims, settles, renews leases, recovers, reconnects, shuts down.
//! * [`error`]: the crate's [`Error`] type.
//! * `testing` (feature `test-util`): throwaway `redis-server` processes for
//!   tests, benches and examples: single servers (restartable from their own
//!   snapshot), clusters, and primary + replica pairs for failover tests.
//!
//! Every Redis operation that changes more than one key is a Lua script kept
//! next to the module that uses it (`*.lua`, loaded with `include_str!`).
#![warn(
    missing_debug_implementations,
    missing_docs,
    rust_2018_idioms,
    unreachable_pub
)]
#![forbid(unsafe_code)]

mod backoff;
pub mod error;
mod functions;
mod keys;
pub mod layer;
pub mod lock;
mod outcome;
pub mod queue;
mod script;
pub mod telemetry;
// Inlined, so that `cargo doc -p lockgate --no-deps` (and docs.rs) show the
// module's pages; a plain re-export of another crate would be one line
// linking to documentation that `--no-deps` does not build.
/// Throwaway `redis-server`, Redis Cluster and `nats-server` processes for
/// tests, benches and examples (the `lockgate-testing` crate).
#[cfg(feature = "test-util")]
#[doc(inline)]
pub use lockgate_testing as testing;
pub mod worker;

pub use backoff::Backoff;
pub use error::{Error, Result};
pub use functions::{Library, delete_stale_functions, function_libraries};
pub use keys::delete_prefix;
pub use layer::{HeldLock, LockGuard, LockLayer, OnConflict, OnLost, Permits};
pub use lock::{Acquisition, Contended, Lease, Locker, ReleaseListener};
pub use outcome::Outcome;
pub use queue::{Job, PushOptions, Queue};
pub use worker::Worker;

/// The boxed error type of lockgate's middleware, as in tower.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
