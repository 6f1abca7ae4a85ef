//! Calling the crate's Lua scripts and functions.
//!
//! redis-rs's `ScriptInvocation` gathers each key and argument in a vector
//! of its own and copies them into a command when sent; on the hot paths
//! (a lock cycle is two script calls) that showed in profiles. Here an
//! `EVALSHA` (or an `FCALL`) is written straight into one command buffer,
//! and the script or library is loaded only when the server answers that
//! it does not know it (a new server, a restart, `SCRIPT FLUSH`,
//! `FUNCTION FLUSH`), as redis-rs does for scripts. Commands start with
//! room for their arguments.
//!
//! A script runs its whole source on every call: with the keyed queue's
//! helpers that is about 170 closures and tables made and dropped per
//! call, 14 of the done script's 16 µs when it has nothing to do. A
//! function of a library (Redis 7's `FUNCTION LOAD`, Valkey's alike) runs
//! its library's source once, when loaded, and each call only the
//! function: the keyed queue's hottest scripts (`queue::keyed`) run so.

use std::sync::LazyLock;

use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, RedisResult, Script, ServerErrorKind};

/// Lua the crate calls: a [`Script`] by its hash, or a [`Function`].
pub(crate) trait Program: Sync {
    /// The call of it that will be given `keys` keys: append the keys,
    /// then the arguments, with `Cmd::arg`.
    fn call(&self, keys: usize) -> Cmd;

    /// Makes the server (on a Redis Cluster, every primary) know it.
    fn load<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> impl Future<Output = RedisResult<()>> + Send;

    /// Whether `error` says the server does not know it.
    fn unknown(&self, error: &RedisError) -> bool;
}

impl Program for Script {
    fn call(&self, keys: usize) -> Cmd {
        let mut cmd = command("EVALSHA");
        cmd.arg(self.get_hash()).arg(keys);
        cmd
    }

    async fn load<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<()> {
        self.prepare_invoke().load_async(conn).await.map(drop)
    }

    fn unknown(&self, error: &RedisError) -> bool {
        error.kind() == ErrorKind::Server(ServerErrorKind::NoScript)
    }
}

impl<P: Program + Send, F: FnOnce() -> P + Send> Program for LazyLock<P, F> {
    fn call(&self, keys: usize) -> Cmd {
        (**self).call(keys)
    }

    fn load<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
    ) -> impl Future<Output = RedisResult<()>> + Send {
        (**self).load(conn)
    }

    fn unknown(&self, error: &RedisError) -> bool {
        (**self).unknown(error)
    }
}

/// A function in a library of its own, both named after a kind and the
/// SHA-1 of the source (`lockgate_<kind>_<sha1>`), so that processes of
/// different versions of lockgate on one server each call their own.
/// Loading it again (`FUNCTION LOAD REPLACE`) changes nothing: its name
/// is its source. On a Redis Cluster redis-rs loads it on every primary.
pub(crate) struct Function {
    name: String,
    library: String,
}

impl Function {
    /// The function `kind` whose library's source is `source`: Lua that
    /// may use `KEYS` and `ARGV` (the call's, set before it runs: the
    /// library declares them) and ends with `return <callback>`, the
    /// function called with a call's keys and arguments.
    pub(crate) fn new(kind: &str, source: &str) -> Self {
        let name = format!("lockgate_{kind}_{}", Script::new(source).get_hash());
        let library = format!(
            "#!lua name={name}\nlocal KEYS, ARGV\nlocal call = (function()\n{source}\nend)()\nredis.register_function('{name}', function(keys, args)\n  KEYS, ARGV = keys, args\n  return call(keys, args)\nend)\n"
        );
        Function { name, library }
    }
}

impl Function {
    /// The function's name, its library's too.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
}

impl Program for Function {
    fn call(&self, keys: usize) -> Cmd {
        let mut cmd = command("FCALL");
        cmd.arg(&self.name).arg(keys);
        cmd
    }

    async fn load<C: ConnectionLike + Send>(&self, conn: &mut C) -> RedisResult<()> {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg("REPLACE").arg(&self.library);
        cmd.query_async::<redis::Value>(conn).await.map(drop)
    }

    fn unknown(&self, error: &RedisError) -> bool {
        let not_found =
            |detail: Option<&str>| detail.is_some_and(|d| d.starts_with("Function not found"));
        // A pipeline's error (`run_after`, `run_then`) has no detail of its
        // own: its commands' errors do.
        not_found(error.detail())
            || (error.clone().into_server_errors())
                .is_some_and(|errors| errors.iter().any(|(_, e)| not_found(e.details())))
    }
}

/// A command named `name`, with room for the arguments of this crate's
/// commands: `redis::cmd` starts empty, and its buffers grow a few times
/// (an allocation each) while the arguments go in.
pub(crate) fn command(name: &str) -> Cmd {
    let mut cmd = Cmd::with_capacity(16, 256);
    cmd.arg(name);
    cmd
}

/// Sends a call `cmd` of `program` (see [`Program::call`]), loading it
/// first if the server does not know it yet.
pub(crate) async fn run<T: FromRedisValue>(
    program: &impl Program,
    cmd: &Cmd,
    conn: &mut (impl ConnectionLike + Send),
) -> RedisResult<T> {
    match cmd.query_async(conn).await {
        // Boxed: the rare path keeps every caller's future small.
        Err(e) if program.unknown(&e) => {
            Box::pin(async {
                program.load(conn).await?;
                cmd.query_async(conn).await
            })
            .await
        }
        result => result,
    }
}

/// Sends `first`, then the call `cmd` of `program`, in one round trip
/// (a pipeline: on one connection to one server, in this order), loading
/// it when the server does not know it yet; returns its reply. `first`
/// runs again then: it must be safe to repeat.
pub(crate) async fn run_after<T: FromRedisValue>(
    program: &impl Program,
    first: &Cmd,
    cmd: &Cmd,
    conn: &mut (impl ConnectionLike + Send),
) -> RedisResult<T> {
    let mut pipe = redis::pipe();
    pipe.add_command(first.clone())
        .ignore()
        .add_command(cmd.clone());
    match pipe.query_async::<(T,)>(conn).await {
        Err(e) if program.unknown(&e) => {
            program.load(conn).await?;
            pipe.query_async::<(T,)>(conn).await.map(|(reply,)| reply)
        }
        result => result.map(|(reply,)| reply),
    }
}

/// Sends the call `cmd` of `program`, then `then`, in one round trip
/// (a pipeline: in this order, on one connection to one server, or to the
/// one node of a cluster that serves both's keys), loading it when the
/// server does not know it yet; returns both replies.
pub(crate) async fn run_then<T: FromRedisValue, U: FromRedisValue>(
    program: &impl Program,
    cmd: &Cmd,
    then: &Cmd,
    conn: &mut (impl ConnectionLike + Send),
) -> RedisResult<(T, U)> {
    let mut pipe = redis::pipe();
    pipe.add_command(cmd.clone()).add_command(then.clone());
    match pipe.query_async::<(T, U)>(conn).await {
        Err(e) if program.unknown(&e) => {
            program.load(conn).await?;
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
