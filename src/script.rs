//! Calling the crate's Lua scripts.
//!
//! redis-rs's `ScriptInvocation` gathers each key and argument in a vector
//! of its own and copies them into a command when sent; on the hot paths
//! (a lock cycle is two script calls) that showed in profiles. Here an
//! `EVALSHA` is written straight into one command buffer, and the script is
//! loaded only when the server answers `NOSCRIPT` (a new server, a restart,
//! `SCRIPT FLUSH`), as redis-rs does. Commands start with room for their
//! arguments.

use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind};

/// An `EVALSHA` of `script` that will be given `keys` keys: append the keys,
/// then the arguments, with `Cmd::arg`.
pub(crate) fn evalsha(script: &Script, keys: usize) -> Cmd {
    let mut cmd = command("EVALSHA");
    cmd.arg(script.get_hash()).arg(keys);
    cmd
}

/// A command named `name`, with room for the arguments of this crate's
/// commands: `redis::cmd` starts empty, and its buffers grow a few times
/// (an allocation each) while the arguments go in.
pub(crate) fn command(name: &str) -> Cmd {
    let mut cmd = Cmd::with_capacity(16, 256);
    cmd.arg(name);
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
        // Boxed: the rare path keeps every caller's future small.
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            Box::pin(async {
                script.prepare_invoke().load_async(conn).await?;
                cmd.query_async(conn).await
            })
            .await
        }
        result => result,
    }
}

/// Sends `first`, then the `EVALSHA` `cmd` of `script`, in one round trip
/// (a pipeline: on one connection to one server, in this order), loading
/// the script when the server does not know it yet; returns the script's
/// reply. `first` runs again then: it must be safe to repeat.
pub(crate) async fn run_after<T: FromRedisValue>(
    script: &Script,
    first: &Cmd,
    cmd: &Cmd,
    conn: &mut (impl ConnectionLike + Send),
) -> RedisResult<T> {
    let mut pipe = redis::pipe();
    pipe.add_command(first.clone())
        .ignore()
        .add_command(cmd.clone());
    match pipe.query_async::<(T,)>(conn).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.prepare_invoke().load_async(conn).await?;
            pipe.query_async::<(T,)>(conn).await.map(|(reply,)| reply)
        }
        result => result.map(|(reply,)| reply),
    }
}

/// Sends the `EVALSHA` `cmd` of `script`, then `then`, in one round trip
/// (a pipeline: in this order, on one connection to one server, or to the
/// one node of a cluster that serves both's keys), loading the script when
/// the server does not know it yet; returns both replies.
pub(crate) async fn run_then<T: FromRedisValue, U: FromRedisValue>(
    script: &Script,
    cmd: &Cmd,
    then: &Cmd,
    conn: &mut (impl ConnectionLike + Send),
) -> RedisResult<(T, U)> {
    let mut pipe = redis::pipe();
    pipe.add_command(cmd.clone()).add_command(then.clone());
    match pipe.query_async::<(T, U)>(conn).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.prepare_invoke().load_async(conn).await?;
            pipe.query_async::<(T, U)>(conn).await
        }
        result => result,
    }
}

/// Whether a failed request may have run on the server all the same: only
/// when no answer came (a timeout, a dropped connection, an I/O error). An
/// error reply (`READONLY`, `LOADING`, `NOPERM`, `OOM`, ...) or a refused
/// connection says it did not run.
pub(crate) fn may_have_run(error: &redis::RedisError) -> bool {
    (error.is_timeout() || error.is_io_error() || error.is_connection_dropped())
        && !error.is_connection_refusal()
}

/// How long a call that is safe to resend (the claim scripts, with the
/// record of their first run) is sent again while its replies are lost:
/// half its `lease`, at most 2 s (four of redis-rs's default response
/// timeouts). Its record is kept as long: records are made at the rate of
/// claims and hand-overs, and must not pile up. A longer outage ends the
/// resends; the messages come back after their lease, as before.
pub(crate) fn resend_window(lease: std::time::Duration) -> std::time::Duration {
    (lease / 2).min(std::time::Duration::from_secs(2))
}

/// Sends a call with `send`, again and unchanged while it fails without an
/// answer (see [`may_have_run`]), with a short growing pause, for up to
/// `window`: for a call whose script keeps a record of its first run, so
/// that a resend answers what that run did (a claim's reply lost on the
/// way must not leave its messages leased to nobody).
pub(crate) async fn resending<T, F>(
    window: std::time::Duration,
    mut send: impl FnMut() -> F,
) -> RedisResult<T>
where
    F: Future<Output = RedisResult<T>>,
{
    let give_up = tokio::time::Instant::now() + window;
    let mut pause = std::time::Duration::from_millis(20);
    loop {
        match send().await {
            Err(error) if may_have_run(&error) && tokio::time::Instant::now() + pause < give_up => {
                tracing::debug!(%error, ?pause, "no answer to a call that is safe to resend; sending it again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_millis(250));
            }
            answer => return answer,
        }
    }
}
