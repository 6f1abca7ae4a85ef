//! Certificates for TLS-only test servers (features `test-util` and `tls`).
//!
//! One certificate authority per test process, made on first use, signs one
//! server certificate for `127.0.0.1` and `localhost`. Every TLS server of
//! the process presents that certificate (so the nodes of a cluster trust
//! each other on their bus), and every client the harness builds trusts
//! that authority alone: the certificate is verified, not waved through.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

/// The authority's certificate, and the server's certificate and key, as PEM.
#[derive(Debug)]
struct Material {
    ca: String,
    cert: String,
    key: String,
}

/// The process's certificates, made on first use.
fn material() -> Result<&'static Material, String> {
    static MATERIAL: OnceLock<Result<Material, String>> = OnceLock::new();
    MATERIAL
        .get_or_init(|| make().map_err(|e| format!("making a test certificate: {e}")))
        .as_ref()
        .map_err(Clone::clone)
}

fn make() -> Result<Material, rcgen::Error> {
    let mut ca = CertificateParams::new(Vec::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "lockgate test authority");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])?
        .signed_by(&key, &ca)?;
    Ok(Material {
        ca: ca.pem(),
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// Writes the certificates into a server's directory and returns the
/// `redis-server` arguments that serve TLS alone on `port`.
pub(super) fn server_args(dir: &Path, port: u16) -> Result<Vec<String>, String> {
    let material = material()?;
    let write = |name: &str, pem: &str| -> Result<PathBuf, String> {
        let path = dir.join(name);
        std::fs::write(&path, pem).map_err(|e| format!("writing {}: {e}", path.display()))?;
        Ok(path)
    };
    let ca = write("ca.crt", &material.ca)?;
    let cert = write("server.crt", &material.cert)?;
    let key = write("server.key", &material.key)?;
    let mut args = vec!["--port".to_owned(), "0".to_owned()];
    args.extend(["--tls-port".to_owned(), port.to_string()]);
    for (flag, path) in [
        ("--tls-ca-cert-file", ca),
        ("--tls-cert-file", cert),
        ("--tls-key-file", key),
    ] {
        args.push(flag.to_owned());
        args.push(path.display().to_string());
    }
    // Clients prove nothing; they check the server against the authority.
    args.extend(["--tls-auth-clients".to_owned(), "no".to_owned()]);
    Ok(args)
}

/// What a client needs to trust the test servers: the authority alone.
///
/// For clients the harness does not build itself, such as a
/// [`ClusterClientBuilder`](redis::cluster::ClusterClientBuilder) given to
/// lockgate's `ReleaseListener::connect_cluster`
/// (`.certs(certificates())`) or a [`redis::Client::build_with_tls`].
pub fn certificates() -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        // An unusable certificate makes every connection fail with the
        // reason, which `RedisServer::start` reports.
        root_cert: Some(
            material()
                .map(|m| m.ca.clone())
                .unwrap_or_default()
                .into_bytes(),
        ),
    }
}

/// A client for a TLS server's `rediss://` URL, trusting the authority.
pub(super) fn client(url: &str) -> redis::RedisResult<redis::Client> {
    redis::Client::build_with_tls(url, certificates())
}
