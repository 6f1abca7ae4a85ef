//! A throwaway `nats-server` with JetStream, for broker pipelines in tests
//! and examples.

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{START_TIMEOUT, StartError, on_a_free_port};

/// A private `nats-server -js` on a free loopback port, its JetStream
/// store in a temporary directory; killed (the directory removed) when
/// dropped.
///
/// The binary is taken from `LOCKGATE_NATS_SERVER` when set, else from
/// `PATH`; when it is missing, [`NatsServer::start`] fails with
/// [`StartError::NatsNotInstalled`], whose message says how to install it.
///
/// ```no_run
/// # fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let nats = lockgate_testing::NatsServer::start()?;
/// println!("JetStream at {}", nats.url()); // nats://127.0.0.1:<port>
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl NatsServer {
    /// Starts a server and waits until it accepts clients.
    pub fn start() -> Result<Self, StartError> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "lockgate-nats-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let mut server = NatsServer {
            child: None,
            port: 0,
            dir,
        };
        on_a_free_port(|port| {
            server.port = port;
            server.spawn()
        })?;
        Ok(server)
    }

    /// The loopback port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The server's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn spawn(&mut self) -> Result<(), StartError> {
        let binary = std::env::var("LOCKGATE_NATS_SERVER").unwrap_or_else(|_| "nats-server".into());
        let _ = std::fs::create_dir_all(&self.dir);
        let log = self.dir.join("nats.log");
        let child = Command::new(&binary)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js"])
            .arg("-sd")
            .arg(self.dir.join("jetstream"))
            .arg("-l")
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| match source.kind() {
                std::io::ErrorKind::NotFound => StartError::NatsNotInstalled {
                    binary: binary.clone(),
                },
                _ => StartError::Spawn {
                    binary: binary.clone(),
                    source,
                },
            })?;
        self.child = Some(child);
        let port = self.port;
        let not_ready = |reason: String| StartError::NotReady {
            port,
            reason,
            log: std::fs::read_to_string(&log).unwrap_or_default(),
        };
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let Some(child) = self.child.as_mut() else {
                return Err(not_ready("it was stopped".into()));
            };
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(not_ready(format!("it exited with {status}")));
            }
            // Ours is up once its log says so (another server that took the
            // port would not write to this log) and it greets clients.
            let ready =
                std::fs::read_to_string(&log).is_ok_and(|text| text.contains("Server is ready"));
            if ready && greets(port) {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.stop();
                return Err(not_ready(format!("not ready within {START_TIMEOUT:?}")));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether a NATS server on a loopback port sends its `INFO` greeting.
fn greets(port: u16) -> bool {
    let Ok(stream) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line).is_ok() && line.starts_with("INFO ")
}
