//! The queue's Lua scripts, each prefixed with the shared prelude.

use std::sync::LazyLock;

use redis::aio::ConnectionLike;
use redis::{Cmd, FromRedisValue, RedisResult, Script, ScriptInvocation};

use crate::error::{Error, Result};

/// A script, hashed on first use.
pub(crate) type Lazy = LazyLock<Script>;

pub(crate) static PUSH: Lazy = LazyLock::new(|| load(include_str!("lua/push.lua")));
pub(crate) static CLAIM: Lazy = LazyLock::new(|| load(include_str!("lua/claim.lua")));
pub(crate) static ACK_MANY: Lazy = LazyLock::new(|| counting(include_str!("lua/ack_many.lua")));
pub(crate) static RESCHEDULE: Lazy = LazyLock::new(|| counting(include_str!("lua/reschedule.lua")));
pub(crate) static BURY: Lazy = LazyLock::new(|| counting(include_str!("lua/bury.lua")));
pub(crate) static EXTEND: Lazy = LazyLock::new(|| load(include_str!("lua/extend.lua")));
pub(crate) static RECOVER: Lazy = LazyLock::new(|| counting(include_str!("lua/recover.lua")));
pub(crate) static REQUEUE_DEAD: Lazy = LazyLock::new(|| load(include_str!("lua/requeue_dead.lua")));
pub(crate) static REMOVE: Lazy = LazyLock::new(|| load(include_str!("lua/remove.lua")));
pub(crate) static STATS: Lazy = LazyLock::new(|| counting(include_str!("lua/stats.lua")));
pub(crate) static DEAD: Lazy = LazyLock::new(|| load(include_str!("lua/dead.lua")));
pub(crate) static PEEK: Lazy = LazyLock::new(|| load(include_str!("lua/peek.lua")));

/// A script's source as loaded: the shared prelude, a newline, the script.
pub(crate) fn with_prelude(body: &str) -> String {
    format!("{}\n{body}", include_str!("lua/prelude.lua"))
}

fn load(body: &str) -> Script {
    Script::new(&with_prelude(body))
}

/// The activity counts' functions (`lua/activity.lua`), for the scripts
/// that count messages done or failed, and the one that reads the counts.
pub(crate) const ACTIVITY_LUA: &str = include_str!("lua/activity.lua");

/// A script that counts activity: the prelude, the activity functions, the
/// script.
fn counting(body: &str) -> Script {
    Script::new(&with_prelude(&format!("{ACTIVITY_LUA}\n{body}")))
}

/// A script call or a command, sent on a clone of a queue's connection.
pub(crate) trait Query {
    /// Sends it; `attempted` names it in an error (formatted only then).
    async fn query_on<R, C>(&self, conn: &C, attempted: impl FnOnce() -> String) -> Result<R>
    where
        R: FromRedisValue,
        C: ConnectionLike + Clone + Send;
}

impl Query for ScriptInvocation<'_> {
    async fn query_on<R, C>(&self, conn: &C, attempted: impl FnOnce() -> String) -> Result<R>
    where
        R: FromRedisValue,
        C: ConnectionLike + Clone + Send,
    {
        let reply: RedisResult<R> = self.invoke_async(&mut conn.clone()).await;
        reply.map_err(|e| Error::redis(attempted())(e))
    }
}

impl Query for Cmd {
    async fn query_on<R, C>(&self, conn: &C, attempted: impl FnOnce() -> String) -> Result<R>
    where
        R: FromRedisValue,
        C: ConnectionLike + Clone + Send,
    {
        let reply: RedisResult<R> = self.query_async(&mut conn.clone()).await;
        reply.map_err(|e| Error::redis(attempted())(e))
    }
}

#[cfg(test)]
mod tests {
    /// `scripts/<file>` is what producers in other languages load; it must
    /// never drift from the script the library runs (`sources`). To
    /// regenerate it after changing them, run the tests with
    /// `LOCKGATE_WRITE_SCRIPTS=1`.
    fn check_shipped(file: &str, expected: &str, sources: &str) {
        let path = format!("{}/scripts/{file}", env!("CARGO_MANIFEST_DIR"));
        if std::env::var_os("LOCKGATE_WRITE_SCRIPTS").is_some() {
            std::fs::write(&path, expected).expect("write the shipped script");
        }
        let shipped = std::fs::read_to_string(&path).expect("read the shipped script");
        assert!(
            shipped == expected,
            "scripts/{file} differs from {sources}: \
             regenerate it with LOCKGATE_WRITE_SCRIPTS=1 cargo test --lib shipped"
        );
    }

    #[test]
    fn the_shipped_keyed_push_script_is_the_one_the_library_loads() {
        let expected = super::super::keyed::push_source();
        let sources = "prelude.lua + keyed.lua + keyed_push.lua";
        check_shipped("push_keyed.lua", &expected, sources);
    }

    #[test]
    fn the_shipped_push_script_is_the_one_the_library_loads() {
        let expected = super::with_prelude(include_str!("lua/push.lua"));
        check_shipped("push.lua", &expected, "prelude.lua + push.lua");
    }
}
