//! # Use after `fork()`
//!
//! A forked child shares the parent's device mappings (`MAP_SHARED`) but
//! not its worker threads: a task submitted there would never run, and a
//! write would land in the parent's slots. Each face records the process
//! that opened it; in any other process every call raises `RuntimeError`
//! and `close()` / drop do nothing (the engine is leaked in the child:
//! closing it would join threads that do not exist there, and touch the
//! parent's slots).
//!
//! A call checks twice: first, and again once its arguments are converted
//! and before it reaches the engine. The conversion runs the caller's
//! Python code (a key's `to_string()`, a keys generator), which may fork:
//! the child then goes on inside the parent's call, and a `put_batch`
//! wrote its copy of the caller's buffer into the parent's slots.

use pyo3::exceptions::PyRuntimeError;
use pyo3::PyErr;

/// The process a face was opened in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner {
    pid: u32,
}

impl Owner {
    /// The calling process.
    pub(crate) fn here() -> Owner {
        Owner {
            pid: std::process::id(),
        }
    }

    /// True in a process other than the one that opened it (a child).
    pub(crate) fn forked(self) -> bool {
        std::process::id() != self.pid
    }

    /// `RuntimeError` in a forked child (module doc).
    pub(crate) fn check(self, what: &str) -> Result<(), PyErr> {
        if self.forked() {
            return Err(PyRuntimeError::new_err(format!(
                "daxkv: this {what} was opened in process {} and cannot be used in process {} \
                 (a fork): its workers do not exist here; open a new one in this process",
                self.pid,
                std::process::id()
            )));
        }
        Ok(())
    }
}
