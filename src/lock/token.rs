//! The random tokens that name a lock's holders, each starting with this
//! process's tag.

use std::sync::LazyLock;

/// A random token: 32 lowercase hex digits, kept inline and written without
/// `core::fmt` (one is made for every acquire). The first 8 name this process
/// ([`process_tag`]), so that a release script can tell from a waiter's token
/// whether its process still listens; the other 96 bits are random.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Token([u8; 32]);

const TAG_LEN: usize = 8;
/// Hex digits that start every token of this process: random, drawn once.
static PROCESS_TAG: LazyLock<[u8; TAG_LEN]> = LazyLock::new(|| hex(rand::random::<u128>()));

/// The 8 hex digits that start this process's tokens, and name its
/// listener's presence channels (see [`ReleaseListener`](super::ReleaseListener)).
pub(crate) fn process_tag() -> &'static str {
    // Hex digits only: always UTF-8.
    std::str::from_utf8(&*PROCESS_TAG).unwrap_or_default()
}

/// The first `N` hex digits of `bits`.
fn hex<const N: usize>(bits: u128) -> [u8; N] {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0; N];
    for (i, digit) in out.iter_mut().enumerate() {
        *digit = HEX[((bits >> (4 * (31 - i))) & 0xf) as usize];
    }
    out
}

impl Token {
    pub(crate) fn random() -> Self {
        let mut token: [u8; 32] = hex(rand::random::<u128>());
        token[..TAG_LEN].copy_from_slice(&*PROCESS_TAG);
        Self(token)
    }

    pub(crate) fn as_str(&self) -> &str {
        // Hex digits only: always UTF-8.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl redis::ToRedisArgs for Token {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        out.write_arg(&self.0);
    }
}
