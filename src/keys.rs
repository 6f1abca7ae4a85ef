//! Redis key names, built in one place.
//!
//! Every key a user names (a lock key, a queue name) is placed inside a
//! cluster hash tag, `{...}`, so that all keys derived from it live in one
//! hash slot and one Lua script may touch them all. Redis takes the hash tag
//! from the first `{` to the first `}` after it, so a `}` inside the user's
//! key would end the tag early (and a leading `}` would leave it empty, making
//! the lock and fence keys hash apart). To keep the tag exact and the mapping
//! one-to-one, `\` is written as `\\` and `}` as `\)`. Keys without either
//! character, the usual case, appear verbatim.

use std::borrow::Cow;

use crate::error::{Error, Result};

/// Escapes a user key so it can sit inside `{...}`.
pub(crate) fn tag(key: &str) -> Cow<'_, str> {
    if !key.contains(['}', '\\']) {
        return Cow::Borrowed(key);
    }
    Cow::Owned(key.replace('\\', "\\\\").replace('}', "\\)"))
}

/// `<prefix>:<kind>:{<key>}`, the key's hash tag in braces, built by hand
/// in one allocation: lock and permit keys are made on every acquire.
pub(crate) fn tagged_key(prefix: &str, kind: &str, key: &str) -> String {
    let tag = tag(key);
    let mut out = String::with_capacity(prefix.len() + kind.len() + tag.len() + 4);
    for part in [prefix, ":", kind, ":{", &*tag, "}"] {
        out.push_str(part);
    }
    out
}

/// `<prefix>:lock:{<key>}` ([`Locker::lock_key`](crate::Locker::lock_key)).
pub(crate) fn lock_key(prefix: &str, key: &str) -> String {
    tagged_key(prefix, "lock", key)
}

/// `<prefix>:rate:{<key>}` ([`Locker::rate_key`](crate::Locker::rate_key)).
pub(crate) fn rate_key(prefix: &str, key: &str) -> String {
    tagged_key(prefix, "rate", key)
}

/// The hash slot of the lock on `key` (a Redis Cluster's CRC16 of the
/// lock's hash tag, modulo 16,384).
pub(crate) fn lock_slot(key: &str) -> u16 {
    slot_of(&tag(key))
}

/// A Redis Cluster's number of hash slots.
pub(crate) const SLOTS: u16 = 16_384;

/// The hash slot of `text` (CRC16-XMODEM, as Redis Cluster).
pub(crate) fn slot_of(text: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(text.as_bytes()) % SLOTS
}

/// The tag of `slot`: the smallest non-negative integer whose decimal text
/// hashes to it, so that `{<tag>}` places a key in that slot.
pub(crate) fn slot_tag(slot: u16) -> &'static str {
    static TAGS: std::sync::LazyLock<Vec<String>> = std::sync::LazyLock::new(|| {
        let mut tags = vec![String::new(); usize::from(SLOTS)];
        let (mut left, mut n) = (tags.len(), 0u64);
        while left > 0 {
            let text = n.to_string();
            let tag = &mut tags[usize::from(slot_of(&text))];
            if tag.is_empty() {
                *tag = text;
                left -= 1;
            }
            n += 1;
        }
        tags
    });
    &TAGS[usize::from(slot % SLOTS)]
}

/// The user key an escaped tag (see [`tag`]) stands for.
pub(crate) fn untag(tag: &str) -> String {
    let mut out = String::with_capacity(tag.len());
    let mut chars = tag.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some(')') => out.push('}'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

/// `text` with the glob characters of `SCAN MATCH` escaped.
pub(crate) fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Every key matching `pattern` (`SCAN`, never `KEYS`: the server is not
/// blocked however many keys it holds). On a cluster connection, `SCAN`
/// goes to one node.
pub(crate) async fn scan(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    pattern: &str,
) -> redis::RedisResult<Vec<String>> {
    let mut cursor: u64 = 0;
    let mut keys = Vec::new();
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(conn)
            .await?;
        keys.extend(batch);
        if next == 0 {
            return Ok(keys);
        }
        cursor = next;
    }
}

/// The user keys of the `<prefix>:<kind>:{<key>}` keys whose user key
/// matches the glob `pattern` (see [`scan`]; keys of another shape are left
/// out).
pub(crate) async fn scan_tagged(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    prefix: &str,
    kind: &str,
    pattern: &str,
) -> redis::RedisResult<Vec<String>> {
    let glob = format!("{}:{kind}:{{{pattern}}}", glob_escape(prefix));
    let found = scan(conn, &glob).await?;
    let start = format!("{prefix}:{kind}:{{");
    Ok(found
        .iter()
        .filter_map(|k| k.strip_prefix(&start)?.strip_suffix('}'))
        .map(untag)
        .collect())
}

/// Deletes every key whose name starts with `<prefix>:` (`SCAN`, then
/// `UNLINK` in batches: freed off the main thread), and returns how many went: for throwaway prefixes
/// such as a benchmark's. Never point it at a prefix in use: it deletes
/// locks and messages alike. On a Redis Cluster, call it with a connection
/// to each master in turn.
pub async fn delete_prefix(
    conn: &(impl redis::aio::ConnectionLike + Clone + Send),
    prefix: &str,
) -> Result<usize> {
    check_prefix(prefix)?;
    let attempted = || format!("deleting the keys under `{prefix}:`");
    let mut conn = conn.clone();
    let found = scan(&mut conn, &format!("{}:*", glob_escape(prefix)))
        .await
        .map_err(|e| Error::redis(attempted())(e))?;
    let mut deleted = 0;
    for batch in found.chunks(1000) {
        // One key per command: a cluster node refuses keys of several
        // slots in one.
        let mut pipe = redis::pipe();
        for key in batch {
            pipe.unlink(key);
        }
        let n: Vec<usize> =
            (pipe.query_async(&mut conn).await).map_err(|e| Error::redis(attempted())(e))?;
        deleted += n.iter().sum::<usize>();
    }
    Ok(deleted)
}

/// A key name made of a name and a suffix, written into a command without
/// building a `String` (for keys named on every acquire and release).
#[derive(Clone, Copy)]
pub(crate) struct KeyName<'a>(pub(crate) &'a str, pub(crate) &'static str);

impl redis::ToRedisArgs for KeyName<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write;
        let mut arg = out.writer_for_next_arg();
        // Writes into memory cannot fail.
        let _ = arg.write_all(self.0.as_bytes());
        let _ = arg.write_all(self.1.as_bytes());
    }
}

/// Checks a key prefix: non-empty and free of braces (a brace in the prefix
/// would become the hash tag of every key).
pub(crate) fn check_prefix(prefix: &str) -> Result<()> {
    if prefix.is_empty() {
        return Err(Error::config("key prefix must not be empty"));
    }
    if prefix.contains(['{', '}']) {
        return Err(Error::config(format_args!(
            "key prefix {prefix:?} must not contain `{{` or `}}`: lockgate places its own hash tags"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_keys_are_verbatim() {
        assert_eq!(tag("order:7 ü"), "order:7 ü");
        assert!(matches!(tag("a{b"), Cow::Borrowed(_)));
    }

    #[test]
    fn escaping_is_one_to_one_and_brace_free() {
        let keys = ["}", "\\)", "a}b", "a\\)b", "\\", "\\\\", "}}", "\\}"];
        let tags: Vec<_> = keys.iter().map(|k| tag(k).into_owned()).collect();
        for (i, a) in tags.iter().enumerate() {
            assert!(!a.contains('}'), "{a:?} contains a closing brace");
            for b in &tags[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn untag_reverses_tag() {
        for key in [
            "plain", "}", "\\)", "a}b", "a\\)b", "\\", "\\\\", "}}", "\\}", "x\\",
        ] {
            assert_eq!(untag(&tag(key)), key);
        }
    }

    #[test]
    fn prefixes_are_checked() {
        assert!(check_prefix("").is_err());
        assert!(check_prefix("a{b").is_err());
        assert!(check_prefix("app:locks").is_ok());
    }
}
