//! Benchmarks of lockgate beside its peers, in a crate of their own so that
//! the peers' dependencies stay out of the library's build. See
//! `benches/bullmq.rs`.
