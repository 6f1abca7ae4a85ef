//! Calling the crate's Lua scripts.
//!
//! redis-rs's `ScriptInvocation` gathers each key and argument in a vector
//! of its own and copies them into a command when sent; on the hot paths
//! (a lock cycle is two script calls) that showed in profiles. Here an
//! `EVALSHA` is written straight into one command buffer, and the script is
//! loaded only when the server answers `NOSCRIPT` (a new server, a restart,
//! `SCRIPT FLUSH`), as redis-rs does.

use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind};

/// An `EVALSHA` of `script` that will be given `keys` keys: append the keys,
/// then the arguments, with `Cmd::arg`.
pub(crate) fn evalsha(script: &Script, keys: usize) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(keys);
    cmd
}

/// Sends an `EVALSHA` made by [`evalsha`], loading `script` first if the
/// server does not know it yet.
pub(crate) async fn run<T: FromRedisValue>(
    script: &Script,
    cmd: &Cmd,
    conn: &mut (impl ConnectionLike + Send),
) -> RedisResult<T> {
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.prepare_invoke().load_async(conn).await?;
            cmd.query_async(conn).await
        }
        result => result,
    }
}
