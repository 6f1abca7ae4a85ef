//! A `lockgate dashboard` process for tests, and a small HTTP client.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};

use lockgate::testing::RedisServer;

/// A running dashboard, killed on drop.
pub struct Dashboard {
    child: Child,
    pub base: String,
    agent: ureq::Agent,
    raw: ureq::Agent,
}

impl Dashboard {
    /// Starts `lockgate --url <server> dashboard --bind 127.0.0.1:0 <args>`
    /// and waits for the address it prints.
    pub fn start(server: &RedisServer, args: &[&str]) -> Self {
        Self::start_with_env(server, args, &[])
    }

    /// [`start`](Self::start) with these environment variables set (the
    /// dashboard's own are removed first, so the caller's shell does not
    /// leak into a test).
    pub fn start_with_env(server: &RedisServer, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_lockgate"))
            .args(["--url", &server.url(), "dashboard", "--bind", "127.0.0.1:0"])
            .args(args)
            .env_remove("LOCKGATE_DASHBOARD_TOKEN")
            .env_remove("LOCKGATE_DASHBOARD_ALLOWED_HOSTS")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning lockgate dashboard");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines
            .next()
            .expect("the dashboard prints its address")
            .unwrap();
        let base = line
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .expect("an address")
            .trim_end_matches('/')
            .to_owned();
        // Keep draining its output.
        std::thread::spawn(move || for _ in lines {});
        let config = |redirects| {
            ureq::Agent::config_builder()
                .http_status_as_error(false)
                .max_redirects(redirects)
                .timeout_global(Some(std::time::Duration::from_secs(30)))
                .build()
        };
        Dashboard {
            child,
            base,
            agent: config(5).into(),
            raw: config(0).into(),
        }
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let mut response = self
            .agent
            .get(&format!("{}{path}", self.base))
            .call()
            .unwrap();
        let status = response.status().as_u16();
        (
            status,
            response.body_mut().read_to_string().unwrap_or_default(),
        )
    }

    pub fn get_with_cookie(&self, path: &str, cookie: &str) -> (u16, String) {
        let mut response = self
            .agent
            .get(&format!("{}{path}", self.base))
            .header("Cookie", cookie)
            .call()
            .unwrap();
        let status = response.status().as_u16();
        (
            status,
            response.body_mut().read_to_string().unwrap_or_default(),
        )
    }

    pub fn header(&self, path: &str, name: &str) -> Option<String> {
        let response = self
            .agent
            .get(&format!("{}{path}", self.base))
            .call()
            .unwrap();
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    }

    /// A form POST, following the redirect it answers with.
    pub fn post(&self, path: &str, form: &[(&str, &str)]) -> (u16, String) {
        let mut response = self
            .agent
            .post(&format!("{}{path}", self.base))
            .send_form(form.iter().copied())
            .unwrap();
        let status = response.status().as_u16();
        (
            status,
            response.body_mut().read_to_string().unwrap_or_default(),
        )
    }

    /// A form POST as a browser sends it from another site.
    pub fn post_cross_site(&self, path: &str, form: &[(&str, &str)]) -> (u16, String) {
        let mut response = self
            .agent
            .post(&format!("{}{path}", self.base))
            .header("Sec-Fetch-Site", "cross-site")
            .send_form(form.iter().copied())
            .unwrap();
        let status = response.status().as_u16();
        (
            status,
            response.body_mut().read_to_string().unwrap_or_default(),
        )
    }

    /// Logs in with `token`; returns the cookie to send.
    pub fn login(&self, token: &str) -> String {
        let cookie = self.set_cookie(token);
        cookie.split(';').next().unwrap().to_owned()
    }

    /// Logs in with `token`; returns the whole `Set-Cookie` header.
    pub fn set_cookie(&self, token: &str) -> String {
        let response = self
            .raw
            .get(&format!("{}/login?token={token}", self.base))
            .call()
            .unwrap();
        assert_eq!(response.status().as_u16(), 303);
        let cookie = response
            .headers()
            .get("set-cookie")
            .unwrap()
            .to_str()
            .unwrap();
        assert!(
            cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
            "{cookie}"
        );
        cookie.to_owned()
    }

    /// The port the dashboard listens on.
    pub fn port(&self) -> u16 {
        self.base.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// Sends one request over a fresh connection, written byte for byte as
    /// given (HTTP clients set `Host` from the URL; an attacker's browser
    /// sends the attacker's name): `target` as the request line has it,
    /// `host` as the `Host` header (none when `None`), then `headers`, and
    /// `body` as a form.
    pub fn send(
        &self,
        method: &str,
        target: &str,
        host: Option<&str>,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.port())).unwrap();
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        let mut request = format!("{method} {target} HTTP/1.1\r\n");
        if let Some(host) = host {
            request += &format!("Host: {host}\r\n");
        }
        for (name, value) in headers {
            request += &format!("{name}: {value}\r\n");
        }
        if method == "POST" {
            request += "Content-Type: application/x-www-form-urlencoded\r\n";
        }
        request += &format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        Answer::parse(&String::from_utf8_lossy(&answer))
    }
}

/// An HTTP answer as it came off the wire.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    /// Header names lowercased, values as sent.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Answer {
    fn parse(text: &str) -> Self {
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {text:?}"));
        let headers = lines
            .filter_map(|line| line.split_once(':'))
            .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
            .collect();
        Answer {
            status,
            headers,
            body: body.to_owned(),
        }
    }

    /// The first value of header `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The CSRF token of a page's forms.
pub fn csrf(page: &str) -> String {
    let at = page
        .find(r#"name="csrf" value=""#)
        .expect("a form with a csrf token");
    let rest = &page[at + r#"name="csrf" value=""#.len()..];
    rest[..rest.find('"').unwrap()].to_owned()
}
