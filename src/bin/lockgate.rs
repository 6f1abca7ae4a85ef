//! `lockgate`: inspect and operate lockgate queues and locks from a shell.
//!
//! Redis comes from `REDIS_URL` (default `redis://127.0.0.1:6379/`).

use std::process::ExitCode;
use std::time::Duration;

use lockgate::{BoxError, Locker, PushOptions, Queue};
use redis::aio::ConnectionManager;

const USAGE: &str = "\
usage: lockgate [--prefix <prefix>] <command>

commands:
  stats <queue>                          counts per state
  dead <queue> [count]                   list dead letters (oldest first) with their errors
  requeue <queue> <id> | --all           re-drive dead letters, due now
  remove <queue> <id>                    delete a scheduled or dead message
  push <queue> <json> [--after <ms>] [--id <id>]
  lock <key>                             whether a lock is held, for how long, its fence
  permits <key>                          the holders of a key's permits: leases left, fences

Redis comes from REDIS_URL (default redis://127.0.0.1:6379/).";

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lockgate: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(mut args: Vec<String>) -> Result<(), BoxError> {
    let prefix = take_option(&mut args, "--prefix")?.unwrap_or_else(|| "lockgate".into());
    let Some(command) = (!args.is_empty()).then(|| args.remove(0)) else {
        println!("{USAGE}");
        return Ok(());
    };
    if matches!(command.as_str(), "-h" | "--help" | "help") {
        println!("{USAGE}");
        return Ok(());
    }
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let client = redis::Client::open(url.as_str())?;
    let config = redis::aio::ConnectionManagerConfig::new().set_number_of_retries(1);
    let conn = client.get_connection_manager_with_config(config).await?;
    let queue = |args: &[String]| -> Result<Queue<serde_json::Value, ConnectionManager>, BoxError> {
        let name = args.first().ok_or("missing <queue>")?;
        Ok(Queue::new(conn.clone(), name)?.prefix(&prefix)?)
    };
    match command.as_str() {
        "stats" => {
            let s = queue(&args)?.stats().await?;
            println!("due     {}", s.due);
            println!("later   {}", s.later);
            println!("active  {}", s.active);
            println!("dead    {}", s.dead);
            if let Some(age) = s.oldest_due_age {
                println!("oldest due message waiting for {age:?}");
            }
        }
        "dead" => {
            let count: usize = args.get(1).map(|c| c.parse()).transpose()?.unwrap_or(20);
            let count = count.clamp(1, lockgate::queue::MAX_BATCH);
            let dead = queue(&args)?.dead_letters(0, count).await?;
            if dead.is_empty() {
                println!("no dead letters");
            }
            for d in dead {
                println!(
                    "{}  failures {}  deferrals {}  stalls {}  error: {}\n    {}",
                    d.id,
                    d.failures,
                    d.deferrals,
                    d.stalls,
                    d.error.as_deref().unwrap_or("-"),
                    String::from_utf8_lossy(&d.payload)
                );
            }
        }
        "requeue" => {
            let q = queue(&args)?;
            match args.get(1).map(String::as_str) {
                Some("--all") => println!("re-drove {} dead letters", q.requeue_all_dead().await?),
                Some(id) if q.requeue_dead(id).await? => println!("re-drove {id}"),
                Some(id) => return Err(format!("{id} is not a dead letter").into()),
                None => return Err("missing <id> or --all".into()),
            }
        }
        "remove" => {
            let q = queue(&args)?;
            let id = args.get(1).ok_or("missing <id>")?;
            if !q.remove(id).await? {
                return Err(
                    format!("{id} is not scheduled or dead (absent, or being processed)").into(),
                );
            }
            println!("removed {id}");
        }
        "push" => {
            let after = take_option(&mut args, "--after")?;
            let id = take_option(&mut args, "--id")?;
            let q = queue(&args)?;
            let json = args.get(1).ok_or("missing <json>")?;
            let value: serde_json::Value = serde_json::from_str(json)?;
            let mut options = PushOptions::new();
            if let Some(after) = after {
                options = options.after(Duration::from_millis(after.parse()?));
            }
            if let Some(id) = id {
                options = options.id(id);
            }
            let pushed = q.push_with(value, options).await?;
            let state = if pushed.created {
                "pushed"
            } else {
                "exists already"
            };
            println!("{state}: {}", pushed.id);
        }
        "lock" => {
            let key = args.first().ok_or("missing <key>")?;
            let locker = Locker::new(conn.clone()).prefix(&prefix)?;
            // A held lock stores `<token>[:<fence>][!]`; the last fence
            // issued for the key stays on record a while after the lock.
            match locker.inspect(key).await? {
                Some(holder) => {
                    let fence = holder
                        .fence
                        .map_or("none issued yet".to_owned(), |f| f.to_string());
                    match holder.remaining {
                        Some(ttl) => println!("{key}: held, expires in {ttl:?}, fence {fence}"),
                        None => println!(
                            "{key}: held without expiry (not set by lockgate), fence {fence}"
                        ),
                    }
                }
                None => {
                    let last: Option<u64> = redis::cmd("GET")
                        .arg(locker.fence_key(key))
                        .query_async(&mut conn.clone())
                        .await?;
                    match last {
                        Some(fence) => println!("{key}: free; last fence {fence}"),
                        None => println!(
                            "{key}: free; no fence on record (none issued, or over {:?} ago)",
                            lockgate::lock::FENCE_GRACE
                        ),
                    }
                }
            }
        }
        "permits" => {
            let key = args.first().ok_or("missing <key>")?;
            let locker = Locker::new(conn.clone()).prefix(&prefix)?;
            let holders = locker.permit_holders(key).await?;
            println!("{key}: {} permit(s) in use", holders.len());
            for holder in holders {
                let fence = holder.fence.map_or("none issued".into(), |f| f.to_string());
                println!(
                    "  {}  expires in {:?}, fence {fence}",
                    holder.token, holder.remaining
                );
            }
        }
        other => return Err(format!("unknown command `{other}`\n\n{USAGE}").into()),
    }
    Ok(())
}

/// Removes `--name value` from `args`, returning the value.
fn take_option(args: &mut Vec<String>, name: &str) -> Result<Option<String>, BoxError> {
    let Some(at) = args.iter().position(|a| a == name) else {
        return Ok(None);
    };
    if at + 1 >= args.len() {
        return Err(format!("{name} needs a value").into());
    }
    let value = args.remove(at + 1);
    args.remove(at);
    Ok(Some(value))
}
