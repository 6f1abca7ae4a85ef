//! Runs every example in `examples/` against a throwaway redis-server (and
//! nats-server, for the broker pipeline) and
//! checks that it succeeds and says something.
//!
//! The examples are run through `cargo run --example` (Cargo gives tests no
//! path to example binaries), one after the other so that the cargo
//! invocations do not fight over the build directory lock.

mod support;

use lockgate::testing::{NatsServer, RedisServer};

const EXAMPLES: &[&str] = &[
    "quickstart",
    "strategies",
    "fencing",
    "pipeline",
    "limits",
    "prometheus",
    "nats",
];

#[test]
fn every_example_runs() {
    let server =
        RedisServer::start().unwrap_or_else(|e| panic!("could not start redis-server: {e}"));
    // For examples/nats.rs: JetStream in front of the pipeline.
    let nats = NatsServer::start().unwrap_or_else(|e| panic!("could not start nats-server: {e}"));
    for name in EXAMPLES {
        let output = support::cargo()
            .args([
                "run",
                "--quiet",
                "--example",
                name,
                "--features",
                "test-util",
            ])
            .env("REDIS_URL", server.url())
            .env("NATS_URL", nats.url())
            // For examples/prometheus.rs: a free port, and a short run.
            .env("METRICS_ADDR", free_address())
            .env("RUN_FOR_MS", "1000")
            .output()
            .unwrap_or_else(|e| panic!("could not run cargo for example {name}: {e}"));
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "example {name} failed with {}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
            output.status
        );
        let address = format!("127.0.0.1:{}", server.port());
        assert!(
            stdout.contains(&address),
            "example {name} did not say it used {address}\n--- stdout ---\n{stdout}"
        );
        assert!(
            !stdout.trim().is_empty(),
            "example {name} printed nothing\n--- stderr ---\n{stderr}"
        );
    }
}

/// A loopback address whose port was free a moment ago.
fn free_address() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").to_string()
}
