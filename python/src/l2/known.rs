//! # Known keys: LMCache's key objects for the engine's delete events
//!
//! LMCache's listeners (its LRU, the base class's per-salt byte counters)
//! are told about keys as `ObjectKey`s. A delete the adapter did not ask
//! for (a hotplug evict, a forced shrink) reaches the engine's listener as
//! engine keys (digests) only, so the adapter records, for every key the
//! engine holds, the key object it was stored under (upstream keeps the
//! same map, `_key_to_device`). Generic over the object so the bookkeeping
//! is plain Rust.
//!
//! ## Protocol: stored is always reported before deleted
//!
//! The base class clamps its byte counters at zero and drops a salt's
//! bucket when it reaches zero, so a key's "deleted" event told before its
//! "stored" event corrupts the books for good (an underflow clamped, then
//! the late "stored" counted). Events are told outside any lock of ours
//! (a listener may take LMCache's own locks, which another thread may hold
//! while it calls into the adapter), so the order is kept by hand:
//!
//! ```text
//! collect(ticket t):  under `map`: exists(K)? → record K, pending += 1,
//!                     remember (K, gen) under t      (size: slot or 0)
//! Python:             tell "stored"(K…) ; reported(t)
//! reported(t):        under `map`: pending -= 1 for each (K, gen) of t;
//!                     a deferred delete whose pending reaches 0 → deleted
//! listener(delete K): under `map`: K recorded? pending == 0 → deleted,
//!                     else deferred until its reports are done
//! take_deleted():     the deleted list (told "deleted" by the caller)
//! ```
//!
//! The interleavings this closes (`test_l2_adapter.py::
//! test_delete_racing_store_collection` runs them):
//!
//! ```text
//! 1. collect: exists(K)=true ............ record K
//!    delete:              delete K; listener: K not recorded → ignored
//!    → K recorded (and counted) for good.
//!    Closed: exists and record happen under `map`, which the listener
//!    takes too (the listener runs with no engine state held, and
//!    `exists` waits for nothing, so this cannot deadlock).
//! 2. collect: record K ; ............................ tell "stored" K
//!    delete:             delete K; listener; tell "deleted" K
//!    → "deleted" before "stored".
//!    Closed: the delete is deferred while K's "stored" is pending.
//! ```
//!
//! ```text
//! 3. delete:  delete K (old copy) ........................ listener(K)
//!    store:              store K commits (new copy)
//!    collect:                         exists(K)=true, K recorded → size 0
//!    → the listener would drop the entry and tell "deleted" while the
//!      engine holds the new copy (LMCache's books and LRU would lose a
//!      key the engine keeps).
//!    Closed: the listener asks the engine, under `map`, whether it holds
//!    K again; if so the entry stays, standing for the new copy, which
//!    LMCache has counted once (the old copy's "stored", the new one's
//!    size 0) — exactly the one slot the engine holds. A store of K that
//!    commits after that check finds no entry and counts its slot.
//! ```
//!
//! ```text
//! 4. collect: record K (ticket t1) ; "stored" K not told yet (a listener
//!    raised before it, or a listener is telling it right now)
//!    delete:  delete K; listener: K pending → deferred
//!    store:   store K again (new copy); collect: exists(K)=true
//!    → recorded as a new incarnation (size slot), then t1 reported →
//!      "deleted" K told after the new copy's "stored": LMCache's
//!      books are right (slot + slot − slot) but its LRU drops a key the
//!      engine holds, which LMCache then never evicts.
//!    Closed: a key recorded while a delete of it is deferred (never
//!    told) takes that incarnation back: the delete is canceled, the
//!    entry stands for the new copy, size 0 (LMCache counted the old copy
//!    once and never hears it deleted: one slot, as the engine holds).
//!    (`test_l2_collect.py`: the two `restore_behind_a_deferred_delete`
//!    tests.)
//! ```

use daxkv::plumbing::hash::Map;

use daxkv::Key;

/// One recorded key.
struct Entry<T> {
    obj: T,
    /// Which incarnation of the key (a new one after each delete).
    generation: u64,
    /// Collections of it whose "stored" event is not told yet.
    pending: u32,
}

/// The record (module doc). Not thread-safe by itself: the caller keeps it
/// under one mutex.
pub(crate) struct Known<T> {
    keys: Map<Key, Entry<T>>,
    /// Deleted while their "stored" was pending: `(key, generation) →
    /// (object, reports still pending)`.
    deferred: Map<(Key, u64), (T, u32)>,
    /// The generation of a key's deferred delete, for [`Known::record`]
    /// (interleaving 4): at most one per key (a record takes it back
    /// before a key can be recorded, and so deferred, again).
    deferred_generation: Map<Key, u64>,
    /// Per collection ticket, the incarnations it recorded.
    tickets: Map<u64, Vec<(Key, u64)>>,
    /// Deleted, "stored" told, "deleted" not yet.
    deleted: Vec<T>,
    next_generation: u64,
    next_ticket: u64,
}

impl<T> Default for Known<T> {
    fn default() -> Self {
        Known {
            keys: Map::default(),
            deferred: Map::default(),
            deferred_generation: Map::default(),
            tickets: Map::default(),
            deleted: Vec::new(),
            next_generation: 1,
            next_ticket: 1,
        }
    }
}

impl<T> Known<T> {
    /// A ticket for one collection (never 0).
    pub(crate) fn ticket(&mut self) -> u64 {
        let t = self.next_ticket;
        self.next_ticket += 1;
        t
    }

    /// Record `obj` as the key object of `key`, collected under `ticket`,
    /// which the engine holds now (checked under the same lock). Returns
    /// `true` when the key was not recorded (a first store: count its
    /// slot), `false` for a key already recorded (a store of a key already
    /// held: size 0; `obj` is handed back to drop) or one whose delete is
    /// deferred and not told (interleaving 4: the delete is canceled, size
    /// 0, `obj` handed back).
    pub(crate) fn record(&mut self, key: Key, obj: T, ticket: u64) -> (bool, Option<T>) {
        use std::collections::hash_map::Entry as Slot;
        // One probe of `keys` either way (the entry API).
        let (first, generation, back) = match self.keys.entry(key) {
            Slot::Occupied(mut e) => {
                let e = e.get_mut();
                e.pending += 1;
                (false, e.generation, Some(obj))
            }
            Slot::Vacant(v) => {
                // A delete of it deferred, never told (interleaving 4):
                // this copy takes that incarnation back, size 0.
                let back = self
                    .deferred_generation
                    .remove(&key)
                    .and_then(|g| Some((g, self.deferred.remove(&(key, g))?)));
                match back {
                    Some((generation, (old, pending))) => {
                        v.insert(Entry {
                            obj: old,
                            generation,
                            pending: pending + 1,
                        });
                        (false, generation, Some(obj))
                    }
                    None => {
                        let generation = self.next_generation;
                        self.next_generation += 1;
                        v.insert(Entry {
                            obj,
                            generation,
                            pending: 1,
                        });
                        (true, generation, None)
                    }
                }
            }
        };
        self.tickets
            .entry(ticket)
            .or_default()
            .push((key, generation));
        (first, back)
    }

    /// The "stored" events of `ticket` have been told: deletes waiting for
    /// them become reportable.
    pub(crate) fn reported(&mut self, ticket: u64) {
        for (key, generation) in self.tickets.remove(&ticket).unwrap_or_default() {
            if let Some(e) = self.keys.get_mut(&key) {
                if e.generation == generation {
                    e.pending = e.pending.saturating_sub(1);
                    continue;
                }
            }
            if let Some(d) = self.deferred.get_mut(&(key, generation)) {
                d.1 = d.1.saturating_sub(1);
                if d.1 == 0 {
                    if let Some((obj, _)) = self.deferred.remove(&(key, generation)) {
                        self.deleted.push(obj);
                    }
                    if self.deferred_generation.get(&key) == Some(&generation) {
                        self.deferred_generation.remove(&key);
                    }
                }
            }
        }
    }

    /// The engine deleted `keys` (the listener); `held[i]`: the engine
    /// holds `keys[i]` again now (a newer copy, stored after the delete:
    /// the entry stands for it and stays; interleaving 3). Returns how
    /// many deletes this made due now (their "stored" was told), for
    /// `take_deleted`.
    pub(crate) fn on_deleted(&mut self, keys: &[Key], held: &[bool]) -> usize {
        let before = self.deleted.len();
        for (i, k) in keys.iter().enumerate() {
            if held.get(i).copied().unwrap_or(false) {
                continue;
            }
            if let Some(e) = self.keys.remove(k) {
                if e.pending == 0 {
                    self.deleted.push(e.obj);
                } else {
                    self.deferred.insert((*k, e.generation), (e.obj, e.pending));
                    self.deferred_generation.insert(*k, e.generation);
                }
            }
        }
        self.deleted.len() - before
    }

    /// Deleted keys whose "deleted" event is due, each once.
    pub(crate) fn take_deleted(&mut self) -> Vec<T> {
        std::mem::take(&mut self.deleted)
    }

    /// Forget everything (the adapter closed): every object, to drop.
    pub(crate) fn clear(&mut self) -> Vec<T> {
        self.tickets.clear();
        self.deferred_generation.clear();
        self.keys
            .drain()
            .map(|(_, e)| e.obj)
            .chain(self.deferred.drain().map(|(_, (o, _))| o))
            .collect()
    }
}
