//! Logins: a random session id in the cookie, never the token.
//!
//! A cookie that leaks (a browser profile copied, a proxy's log line, a
//! screenshot of the developer tools) then gives away one session that ends
//! on its own, not the token that opens every future one.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The sessions a dashboard has opened, each with its end.
pub(crate) struct Sessions {
    lifetime: Duration,
    open: Mutex<HashMap<String, Instant>>,
}

impl Sessions {
    /// No sessions yet; each one opened lasts `lifetime`.
    pub(crate) fn new(lifetime: Duration) -> Self {
        Sessions {
            lifetime,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// How long a session lasts (the cookie's `Max-Age`).
    pub(crate) fn lifetime(&self) -> Duration {
        self.lifetime
    }

    /// Opens a session: returns its id, 32 random bytes in hex.
    pub(crate) fn open(&self) -> String {
        self.open_at(Instant::now())
    }

    /// Whether `id` is a session opened here and not ended yet.
    pub(crate) fn valid(&self, id: &str) -> bool {
        self.valid_at(id, Instant::now())
    }

    fn open_at(&self, now: Instant) -> String {
        // ThreadRng: a CSPRNG seeded from the operating system.
        let bytes: [u8; 32] = rand::random();
        let id = bytes.iter().fold(String::new(), |mut hex, b| {
            let _ = write!(hex, "{b:02x}");
            hex
        });
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        // Ended sessions go at each login, so the map holds only live ones.
        open.retain(|_, ends| *ends > now);
        open.insert(id.clone(), now + self.lifetime);
        id
    }

    fn valid_at(&self, id: &str, now: Instant) -> bool {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.get(id).is_some_and(|ends| *ends > now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_random_and_ends_after_its_lifetime() {
        let sessions = Sessions::new(Duration::from_secs(60));
        let start = Instant::now();
        let id = sessions.open_at(start);
        assert_eq!(id.len(), 64);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(id, sessions.open_at(start), "each login its own");
        assert!(sessions.valid_at(&id, start + Duration::from_secs(59)));
        assert!(!sessions.valid_at(&id, start + Duration::from_secs(60)));
        assert!(!sessions.valid_at("made-up", start));
        assert!(!sessions.valid_at("", start));
    }

    #[test]
    fn ended_sessions_are_dropped_at_the_next_login() {
        let sessions = Sessions::new(Duration::from_secs(60));
        let start = Instant::now();
        let old = sessions.open_at(start);
        let new = sessions.open_at(start + Duration::from_secs(61));
        let open = sessions.open.lock().unwrap();
        assert!(!open.contains_key(&old) && open.contains_key(&new));
    }
}
