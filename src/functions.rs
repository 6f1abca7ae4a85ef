//! The function libraries lockgate loads on the server (see "Scripts and
//! functions" in docs/internals.md): each named `lockgate_<kind>_<sha1>`
//! after its source, so that processes of different versions each call
//! their own. An upgrade leaves the older version's behind; these list and
//! delete them.

use redis::aio::ConnectionLike;
use redis::{FromRedisValue, Value};

use crate::error::{Error, Result};

/// What every library lockgate loads is named with.
const PREFIX: &str = "lockgate_";

/// A function library lockgate loaded on the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Library {
    /// Its name, `lockgate_<kind>_<sha1 of its source>`.
    pub name: String,
    /// Whether this version of lockgate calls it.
    pub current: bool,
}

/// The function libraries lockgate loaded on the server (on a Redis
/// Cluster, on the node that answers: every primary loads the same), this
/// version's and others', by name.
pub async fn function_libraries(
    conn: &(impl ConnectionLike + Clone + Send),
) -> Result<Vec<Library>> {
    let attempted = || "listing lockgate's function libraries";
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LIST").arg("LIBRARYNAME").arg(format!("{PREFIX}*"));
    let list: Vec<Value> =
        (cmd.query_async(&mut conn.clone()).await).map_err(Error::redis(attempted()))?;
    let current = crate::queue::libraries();
    let mut libraries = Vec::with_capacity(list.len());
    for library in list {
        let name = library_name(library)
            .ok_or_else(|| Error::reply(attempted(), "a library without a `library_name`"))?;
        // `LIBRARYNAME` takes a glob pattern (some servers may match more).
        if name.starts_with(PREFIX) {
            let current = current.contains(&name.as_str());
            libraries.push(Library { name, current });
        }
    }
    libraries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(libraries)
}

/// Deletes the function libraries of other lockgate versions (those
/// [`function_libraries`] finds not current) and returns their names; on a
/// Redis Cluster from every primary. Safe while processes of another
/// version run: such a process loads its library again when it next calls
/// it (one `FUNCTION LOAD` per library, on each node it calls), as after
/// a restart without persistence. Libraries not named `lockgate_` are left
/// alone.
pub async fn delete_stale_functions(
    conn: &(impl ConnectionLike + Clone + Send),
) -> Result<Vec<String>> {
    let stale: Vec<String> = (function_libraries(conn).await?.into_iter())
        .filter(|library| !library.current)
        .map(|library| library.name)
        .collect();
    for name in &stale {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("DELETE").arg(name);
        match cmd.query_async::<()>(&mut conn.clone()).await {
            Ok(()) => {}
            // Gone already: deleted meanwhile, or (on a cluster) missing on
            // a primary added since, the others' deleted all the same.
            Err(error) if is_not_found(&error) => {}
            Err(error) => {
                let attempted = format!("deleting function library `{name}`");
                return Err(Error::redis(attempted)(error));
            }
        }
    }
    Ok(stale)
}

/// A `FUNCTION LIST` entry's `library_name` (a map in RESP3, pairs in RESP2).
fn library_name(library: Value) -> Option<String> {
    let pairs: Vec<(String, Value)> = match library {
        Value::Map(pairs) => (pairs.into_iter())
            .map(|(k, v)| Some((String::from_redis_value(k).ok()?, v)))
            .collect::<Option<_>>()?,
        Value::Array(items) => {
            let mut items = items.into_iter();
            std::iter::from_fn(|| Some((items.next()?, items.next()?)))
                .map(|(k, v)| Some((String::from_redis_value(k).ok()?, v)))
                .collect::<Option<_>>()?
        }
        _ => return None,
    };
    let (_, name) = pairs.into_iter().find(|(k, _)| k == "library_name")?;
    String::from_redis_value(name).ok()
}

fn is_not_found(error: &redis::RedisError) -> bool {
    error
        .detail()
        .is_some_and(|d| d.contains("Library not found"))
        || error.to_string().contains("Library not found")
}
