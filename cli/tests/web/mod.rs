//! A `lockgate dashboard` process for tests, and a small HTTP client.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
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
        let mut child = Command::new(env!("CARGO_BIN_EXE_lockgate"))
            .args(["--url", &server.url(), "dashboard", "--bind", "127.0.0.1:0"])
            .args(args)
            .env_remove("LOCKGATE_DASHBOARD_TOKEN")
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
        cookie.split(';').next().unwrap().to_owned()
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
