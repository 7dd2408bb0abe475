//! # The host: what the machine, its devices and its kernel say
//!
//! Facts read from the host and the syscalls that ask for them; nothing
//! here maps device memory or knows a key.
//!
//! | module | owns |
//! |---|---|
//! | `sys` | syscall wrappers: `memfd_create`, seals, device numbers, thread affinity |
//! | [`devdax`] | device-DAX facts from sysfs (`size`, `align`) |
//! | [`numa`] | device NUMA node, topology and nearest CPUs from sysfs; pinning threads |
//! | [`memlimit`] | memory a memfd or slot table may take (MemAvailable, cgroup limits) |
//! | [`fstype`] | the file systems a device file may live on (no sysfs / procfs pseudo-files) |
//! | [`units`] | byte counts for people (`2 MiB`, exact, else bytes) |
//! | [`probe`] | what a device path is (devdax, kmem, unbound, file, …) from `stat` and sysfs, never opening it; the add / resize gates |

pub mod devdax;
pub mod fstype;
pub mod memlimit;
pub mod numa;
pub mod probe;
pub(crate) mod sys;
pub mod units;
