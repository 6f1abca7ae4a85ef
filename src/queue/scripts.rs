//! The queue's Lua scripts, each prefixed with the shared prelude.

use std::sync::LazyLock;

use redis::Script;

/// Every queue script, hashed once per process.
pub(crate) struct Scripts {
    pub(crate) push: Script,
    pub(crate) claim: Script,
    pub(crate) ack_many: Script,
    pub(crate) reschedule: Script,
    pub(crate) bury: Script,
    pub(crate) extend: Script,
    pub(crate) recover: Script,
    pub(crate) requeue_dead: Script,
    pub(crate) remove: Script,
    pub(crate) stats: Script,
    pub(crate) dead: Script,
    pub(crate) peek: Script,
}

/// A script's source as loaded: the shared prelude, a newline, the script.
fn load(body: &str) -> Script {
    Script::new(&with_prelude(body))
}

fn with_prelude(body: &str) -> String {
    format!("{}\n{body}", include_str!("lua/prelude.lua"))
}

/// The push script as the library loads it; `scripts/push.lua` (for
/// producers in other languages) must be exactly this.
fn push_source() -> String {
    with_prelude(include_str!("lua/push.lua"))
}

impl Scripts {
    pub(crate) fn get() -> &'static Scripts {
        static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
            push: Script::new(&push_source()),
            claim: load(include_str!("lua/claim.lua")),
            ack_many: load(include_str!("lua/ack_many.lua")),
            reschedule: load(include_str!("lua/reschedule.lua")),
            bury: load(include_str!("lua/bury.lua")),
            extend: load(include_str!("lua/extend.lua")),
            recover: load(include_str!("lua/recover.lua")),
            requeue_dead: load(include_str!("lua/requeue_dead.lua")),
            remove: load(include_str!("lua/remove.lua")),
            stats: load(include_str!("lua/stats.lua")),
            dead: load(include_str!("lua/dead.lua")),
            peek: load(include_str!("lua/peek.lua")),
        });
        &SCRIPTS
    }
}

#[cfg(test)]
mod tests {
    /// `scripts/push_keyed.lua`, the keyed push for producers in other
    /// languages, is the library's; regenerate it as `push.lua`'s.
    #[test]
    fn the_shipped_keyed_push_script_is_the_one_the_library_loads() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/push_keyed.lua");
        let expected = super::super::keyed::push_source();
        if std::env::var_os("LOCKGATE_WRITE_SCRIPTS").is_some() {
            std::fs::write(path, &expected).expect("write scripts/push_keyed.lua");
        }
        let shipped = std::fs::read_to_string(path).expect("read scripts/push_keyed.lua");
        assert!(
            shipped == expected,
            "scripts/push_keyed.lua differs from prelude.lua + keyed.lua + keyed_push.lua: \
             regenerate it with LOCKGATE_WRITE_SCRIPTS=1 cargo test shipped_keyed_push_script"
        );
    }

    /// `scripts/push.lua` is what producers in other languages load; it must
    /// never drift from the script the library runs. To regenerate it after
    /// changing `prelude.lua` or `push.lua`, run this test with
    /// `LOCKGATE_WRITE_SCRIPTS=1`.
    #[test]
    fn the_shipped_push_script_is_the_one_the_library_loads() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/push.lua");
        let expected = super::push_source();
        if std::env::var_os("LOCKGATE_WRITE_SCRIPTS").is_some() {
            std::fs::write(path, &expected).expect("write scripts/push.lua");
        }
        let shipped = std::fs::read_to_string(path).expect("read scripts/push.lua");
        assert!(
            shipped == expected,
            "scripts/push.lua differs from prelude.lua + push.lua: \
             regenerate it with LOCKGATE_WRITE_SCRIPTS=1 cargo test shipped_push_script"
        );
    }
}
