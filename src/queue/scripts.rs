//! The queue's Lua scripts, each prefixed with the shared prelude.

use std::sync::LazyLock;

use redis::Script;

/// Every queue script, hashed once per process.
pub(crate) struct Scripts {
    pub(crate) push: Script,
    pub(crate) claim: Script,
    pub(crate) ack: Script,
    pub(crate) ack_many: Script,
    pub(crate) reschedule: Script,
    pub(crate) bury: Script,
    pub(crate) extend: Script,
    pub(crate) recover: Script,
    pub(crate) requeue_dead: Script,
    pub(crate) remove: Script,
    pub(crate) stats: Script,
    pub(crate) dead: Script,
}

impl Scripts {
    pub(crate) fn get() -> &'static Scripts {
        static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| {
            let load =
                |body: &str| Script::new(&format!("{}\n{body}", include_str!("lua/prelude.lua")));
            Scripts {
                push: load(include_str!("lua/push.lua")),
                claim: load(include_str!("lua/claim.lua")),
                ack: load(include_str!("lua/ack.lua")),
                ack_many: load(include_str!("lua/ack_many.lua")),
                reschedule: load(include_str!("lua/reschedule.lua")),
                bury: load(include_str!("lua/bury.lua")),
                extend: load(include_str!("lua/extend.lua")),
                recover: load(include_str!("lua/recover.lua")),
                requeue_dead: load(include_str!("lua/requeue_dead.lua")),
                remove: load(include_str!("lua/remove.lua")),
                stats: load(include_str!("lua/stats.lua")),
                dead: load(include_str!("lua/dead.lua")),
            }
        });
        &SCRIPTS
    }
}
