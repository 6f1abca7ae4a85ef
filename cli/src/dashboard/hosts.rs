//! Which `Host` a request may name.
//!
//! DNS rebinding: a page on another site points its own name at 127.0.0.1
//! after it loaded, and the browser then treats the dashboard as that
//! site's origin: it lets the page read the dashboard's pages (their form
//! token with them) and marks its POSTs `Sec-Fetch-Site: same-origin`. The
//! one thing such a request cannot hide is the name it was sent to, the
//! `Host` header: the attacker's. So the dashboard answers only to names
//! that cannot be rebound by someone else (its own IP literal, the loopback
//! names) and to those the operator vouches for (`--allowed-host`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

/// A host name and maybe a port, as a `Host` header or `--allowed-host`
/// writes them: `name`, `name:port`, `[v6]`, `[v6]:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Authority {
    /// Lowercased (names are case-insensitive); an IP literal in its
    /// canonical form, IPv6 in brackets, so that `[0::1]` is `[::1]`.
    name: String,
    /// As written: `None` when no port was given.
    port: Option<u16>,
}

impl FromStr for Authority {
    type Err = String;

    /// Parses strictly: no scheme, user, path or white space, and only the
    /// characters of a DNS name or an IP literal, so that a `Host` such as
    /// `127.0.0.1:7070@attacker.example` or `127.0.0.1.attacker.example`
    /// never passes for a loopback name.
    fn from_str(text: &str) -> Result<Self, String> {
        let refuse = || format!("{text:?} is not a host name: give NAME or NAME:PORT");
        let (name, port) = match text.strip_prefix('[') {
            Some(rest) => {
                let (inside, after) = rest.split_once(']').ok_or_else(refuse)?;
                let ip: Ipv6Addr = inside.parse().map_err(|_| refuse())?;
                let port = match after {
                    "" => None,
                    _ => Some(after.strip_prefix(':').ok_or_else(refuse)?),
                };
                (format!("[{ip}]"), port)
            }
            None => {
                let (name, port) = match text.split_once(':') {
                    Some((name, port)) => (name, Some(port)),
                    None => (text, None),
                };
                let dns = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_');
                if name.is_empty() || !name.bytes().all(dns) {
                    return Err(refuse());
                }
                let name = match name.parse::<Ipv4Addr>() {
                    Ok(ip) => ip.to_string(),
                    Err(_) => name.to_ascii_lowercase(),
                };
                (name, port)
            }
        };
        let port = match port {
            None => None,
            Some(digits) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
                Some(digits.parse().map_err(|_| refuse())?)
            }
            Some(_) => return Err(refuse()),
        };
        Ok(Authority { name, port })
    }
}

/// An IP address as a `Host` header writes it.
fn literal(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(ip) => ip.to_string(),
        IpAddr::V6(ip) => format!("[{ip}]"),
    }
}

/// Whether a request sent to `host` (a `Host` header's value, or an
/// absolute-form target's authority) is meant for the dashboard listening
/// on `bound`.
///
/// Accepted, with the bound port (no port meaning 80, as in a URL):
/// `localhost`, `127.0.0.1` and `[::1]` (no site can rebind those: browsers
/// resolve them on the machine), and the bound IP itself unless it is the
/// unspecified `0.0.0.0`/`::`. Besides, each of `allowed` (the operator's
/// `--allowed-host`): given without a port it takes any port, since a
/// reverse proxy passes on the port the browser used (often none); given
/// with one, only that port. Names compare case-insensitively.
pub(crate) fn host_allowed(host: &str, bound: SocketAddr, allowed: &[Authority]) -> bool {
    let Ok(host) = host.parse::<Authority>() else {
        return false;
    };
    let port = host.port.unwrap_or(80);
    if allowed
        .iter()
        .any(|a| a.name == host.name && a.port.is_none_or(|p| p == port))
    {
        return true;
    }
    if port != bound.port() {
        return false;
    }
    let own = !bound.ip().is_unspecified() && host.name == literal(bound.ip());
    own || matches!(host.name.as_str(), "localhost" | "127.0.0.1" | "[::1]")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(names: &[&str]) -> Vec<Authority> {
        names.iter().map(|n| n.parse().unwrap()).collect()
    }

    #[test]
    fn a_loopback_dashboard_answers_to_the_loopback_names_on_its_port() {
        let bound: SocketAddr = "127.0.0.1:7085".parse().unwrap();
        for host in [
            "127.0.0.1:7085",
            "localhost:7085",
            "LOCALHOST:7085",
            "[::1]:7085",
            "[0:0:0:0:0:0:0:1]:7085",
        ] {
            assert!(host_allowed(host, bound, &[]), "{host}");
        }
        for host in [
            "attacker.example:7085",
            "attacker.example",
            "localhost.attacker.example:7085",
            "127.0.0.1.attacker.example:7085",
            "127.0.0.1:7085.attacker.example",
            "attacker.example@127.0.0.1:7085",
            "127.0.0.2:7085",
            "10.9.8.7:7085",
            "[::2]:7085",
            "0.0.0.0:7085",
            "127.0.0.1:7086",
            "localhost:80",
            "localhost",
            "localhost.:7085",
            "127.0.0.1:",
            "127.0.0.1:+7085",
            "[::1]7085",
            "::1:7085",
            "",
            " localhost:7085",
        ] {
            assert!(!host_allowed(host, bound, &[]), "{host}");
        }
    }

    #[test]
    fn no_port_is_port_80() {
        let bound: SocketAddr = "127.0.0.1:80".parse().unwrap();
        assert!(host_allowed("localhost", bound, &[]));
        assert!(host_allowed("127.0.0.1:80", bound, &[]));
        assert!(!host_allowed("localhost:8080", bound, &[]));
    }

    #[test]
    fn a_specific_address_answers_to_itself_an_unspecified_one_does_not() {
        let bound: SocketAddr = "10.1.2.3:7085".parse().unwrap();
        assert!(host_allowed("10.1.2.3:7085", bound, &[]));
        assert!(!host_allowed("10.1.2.4:7085", bound, &[]));
        assert!(!host_allowed("10.1.2.3:7086", bound, &[]));
        let v6: SocketAddr = "[fd00::7]:7085".parse().unwrap();
        assert!(host_allowed("[FD00:0::7]:7085", v6, &[]));
        let any: SocketAddr = "0.0.0.0:7085".parse().unwrap();
        assert!(!host_allowed("0.0.0.0:7085", any, &[]));
        assert!(!host_allowed("10.1.2.3:7085", any, &[]));
        assert!(host_allowed("localhost:7085", any, &[]));
    }

    #[test]
    fn allowed_names_take_any_port_unless_they_give_one() {
        let bound: SocketAddr = "0.0.0.0:7085".parse().unwrap();
        let names = allowed(&["Dash.Example.com", "proxy.example:8443", "[fd00::1]"]);
        for host in [
            "dash.example.com",
            "dash.example.com:443",
            "DASH.EXAMPLE.COM:7085",
            "proxy.example:8443",
            "[fd00::1]:9",
        ] {
            assert!(host_allowed(host, bound, &names), "{host}");
        }
        for host in [
            "proxy.example",
            "proxy.example:443",
            "example.com",
            "dash.example.com.attacker.example",
            "x.dash.example.com",
        ] {
            assert!(!host_allowed(host, bound, &names), "{host}");
        }
    }

    #[test]
    fn an_allowed_host_is_a_name_not_a_url() {
        for bad in [
            "",
            "http://dash.example.com",
            "dash.example.com/",
            "a b",
            "dash.example.com:",
            "dash.example.com:99999",
            "user@dash.example.com",
            "[fd00::1",
            "*.example.com",
        ] {
            assert!(bad.parse::<Authority>().is_err(), "{bad:?}");
        }
    }
}
