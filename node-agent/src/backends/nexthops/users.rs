//! Whether a nexthop can be deleted: what goes through it now. Deleting a nexthop deletes every
//! route through it and changes every group holding it, whoever's they are.

use std::collections::{HashMap, HashSet};

use state::objects::{ObjectId, Op};

use super::NexthopBackend;
use crate::backends::Backend;
use crate::backends::routes::RouteBackend;
use crate::backends::users_watch::UsersWatch;
use crate::kernel::{DumpError, OpError};

/// Applies nexthop operations. Deleting a nexthop deletes every route through it (and changes
/// every group holding it), and the kernel has no lookup of a nexthop's users, so before any
/// delete every route and group is read (a dump of the routes and of the groups alone, not of
/// the whole kernel): a nexthop something still goes through is left alone
/// ([`OpError::InUse`]), whoever's the user is. If they cannot be read, no nexthop is deleted.
pub async fn apply_nexthops(
    nexthops: &mut NexthopBackend,
    routes: Option<&mut RouteBackend>,
    watch: Option<&mut UsersWatch>,
    ops: &[Op],
) -> Vec<Result<(), OpError>> {
    let deleting: HashSet<ObjectId> = ops
        .iter()
        .filter(|op| matches!(op, Op::Delete(_)))
        .map(|op| op.object().id())
        .collect();
    if deleting.is_empty() {
        return nexthops.apply(ops).await;
    }
    let users = users_of(nexthops, routes, watch, &deleting).await;
    let blocked = |op: &Op| -> Option<OpError> {
        if !matches!(op, Op::Delete(_)) {
            return None;
        }
        match &users {
            Err(e) => Some(OpError::Kernel {
                what: format!(
                    "{} {}: reading what might go through it: {e}",
                    op.verb(),
                    op.object()
                ),
                source: std::io::Error::from_raw_os_error(libc::EAGAIN),
            }),
            Ok(users) => users.get(&op.object().id()).map(|user| OpError::InUse {
                what: op.object().to_string(),
                user: user.clone(),
            }),
        }
    };
    let mut results: Vec<Option<Result<(), OpError>>> =
        ops.iter().map(|op| blocked(op).map(Err)).collect();
    let allowed: Vec<Op> = ops
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.is_none())
        .map(|(op, _)| op.clone())
        .collect();
    let mut applied = nexthops.apply(&allowed).await.into_iter();
    for r in results.iter_mut().filter(|r| r.is_none()) {
        *r = applied.next();
    }
    results
        .into_iter()
        .map(|r| r.unwrap_or(Err(OpError::Skipped)))
        .collect()
}

/// What goes through each of the nexthops `ids` now: routes, and groups. Nothing is read when
/// `watch` says nothing could have come to use our nexthops since the last read: the plan
/// already knows every user then (the planner keeps the nexthops others use, and our routes
/// go before their nexthops). Otherwise this is a read of its own: of every route and group.
pub async fn users_of(
    nexthops: &mut NexthopBackend,
    routes: Option<&mut RouteBackend>,
    mut watch: Option<&mut UsersWatch>,
    ids: &HashSet<ObjectId>,
) -> Result<HashMap<ObjectId, String>, DumpError> {
    if let Some(w) = watch.as_deref_mut() {
        if w.unchanged_since_read() {
            return Ok(HashMap::new());
        }
        tracing::debug!(
            nexthops = ids.len(),
            "reading every route and nexthop group before deleting nexthops: something else changed since the last read"
        );
        w.reading();
    }
    let read = async {
        let mut users = nexthops.groups_holding(ids).await?;
        if let Some(r) = routes {
            for (id, user) in r.users_of(ids).await? {
                users.entry(id).or_insert(user);
            }
        }
        Ok(users)
    }
    .await;
    if let (Err(_), Some(w)) = (&read, watch) {
        w.forget();
    }
    read
}
