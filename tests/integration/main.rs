//! The integration tests, against real servers that each test starts
//! (`lockgate::testing`): one test binary with a module per subject, so
//! that the library's generic code is built and linked once for them all,
//! not once per file. Run one subject with
//! `cargo test --all-features --test integration keyed::`.
//!
//! The latency tests (`tests/latency.rs`, which read each command's time
//! in the slow log) and the model (`tests/model/`, CPU-bound property
//! runs) stay binaries of their own: they run after these, not beside
//! them.

#[path = "../support/mod.rs"]
mod support;

mod acl;
mod backoff;
mod chain;
mod cluster;
mod dead_pages;
mod defer_line;
mod events;
mod examples;
mod failover;
mod keyed;
mod layer;
mod lock;
mod lock_guard;
mod metrics;
mod nats;
mod permits;
mod priority;
mod producer;
mod queue;
mod queue_robustness;
mod rate;
mod review;
mod shards;
mod spawned_closure;
mod story;
#[cfg(feature = "tls")]
mod tls;
mod wake;
mod worker;
mod worker_claims;
mod worker_faults;
