//! Per-sandbox cgroups: creation with limits, membership, removal.
//!
//! Built on `cgroups-rs`, which speaks both cgroup v1 (one directory per
//! controller under `/sys/fs/cgroup/<ctrl>`) and v2 (one unified tree).
//! Every sandbox gets `<parent>/<sandbox id>`; `<parent>` is named for Strata
//! (`strata` by default, a unique name per test run) so we never touch a
//! cgroup we did not create. This module owns the limit arithmetic (pure,
//! unit-tested) and the cgroup's lifetime; it does not own processes.

use std::time::{Duration, Instant};

use cgroups_rs::cpu::CpuController;
use cgroups_rs::cpuacct::CpuAcctController;
use cgroups_rs::memory::MemController;
use cgroups_rs::pid::PidController;
use cgroups_rs::{Cgroup, CgroupPid, MaxValue};

use crate::spec::Limits;

/// CFS period used for every sandbox (the kernel default).
pub const CPU_PERIOD_US: u64 = 100_000;
/// Smallest memory limit accepted: below this even the shim cannot start.
pub const MIN_MEMORY: u64 = 4 * 1024 * 1024;
/// Largest memory limit accepted (the cgroup files take a signed 64-bit value).
pub const MAX_MEMORY: u64 = i64::MAX as u64;
/// The kernel's PID_MAX_LIMIT on 64-bit.
pub const MAX_PIDS: u64 = 4 * 1024 * 1024;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LimitsError {
    #[error("memory limit {0} bytes is below the minimum of {MIN_MEMORY} bytes")]
    MemoryTooSmall(u64),
    #[error("pids limit must be at least 1")]
    PidsZero,
    #[error("pids limit {0} is above the kernel's maximum of {MAX_PIDS}")]
    PidsTooLarge(u64),
    #[error("memory limit {0} bytes is above the maximum of {MAX_MEMORY} bytes")]
    MemoryTooLarge(u64),
    #[error("cpus must be a finite number between 0.01 and {max}, got {got}")]
    Cpus { got: f64, max: f64 },
    #[error("disk cap {0} bytes is outside {min}..={max} bytes", min = crate::store::disk::MIN_DISK, max = crate::store::disk::MAX_DISK)]
    Disk(u64),
    #[error("pids limit {got} is above this daemon's maximum of {max} (--max-pids)")]
    PidsAboveMax { got: u64, max: u64 },
    #[error("memory limit {got} bytes is above this daemon's maximum of {max} bytes (--max-memory)")]
    MemoryAboveMax { got: u64, max: u64 },
}

/// podman's default pids limit: a sandbox that asks for none still cannot
/// fill the host's process table (without one, a sandbox once left 3,000
/// zombies in it).
pub const DEFAULT_PIDS: u64 = 2048;

/// The daemon's limits for sandboxes that do not ask (`--default-pids`,
/// `--default-memory`) and the most one may ask for (`--max-pids`,
/// `--max-memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitPolicy {
    pub default_pids: u64,
    pub max_pids: u64,
    pub default_memory: Option<u64>,
    pub max_memory: Option<u64>,
}

impl Default for LimitPolicy {
    fn default() -> Self {
        LimitPolicy { default_pids: DEFAULT_PIDS, max_pids: MAX_PIDS, default_memory: None, max_memory: None }
    }
}

/// A [`LimitPolicy`] that contradicts itself.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PolicyError {
    #[error("--default-pids {default} is above --max-pids {max}")]
    Pids { default: u64, max: u64 },
    #[error("--default-memory {default} is above --max-memory {max}")]
    Memory { default: u64, max: u64 },
    #[error("{flag} {value} is below the minimum of {MIN_MEMORY} bytes")]
    MemoryTooSmall { flag: &'static str, value: u64 },
}

impl LimitPolicy {
    /// Refuse a policy whose defaults are above its maximums, or whose
    /// memory values no sandbox could start with.
    pub fn check(&self) -> Result<(), PolicyError> {
        if self.default_pids > self.max_pids {
            return Err(PolicyError::Pids { default: self.default_pids, max: self.max_pids });
        }
        if let (Some(default), Some(max)) = (self.default_memory, self.max_memory) {
            if default > max {
                return Err(PolicyError::Memory { default, max });
            }
        }
        for (flag, v) in [("--default-memory", self.default_memory), ("--max-memory", self.max_memory)] {
            if let Some(value) = v.filter(|v| *v < MIN_MEMORY) {
                return Err(PolicyError::MemoryTooSmall { flag, value });
            }
        }
        Ok(())
    }

    /// `asked` with the defaults filled in, refused past a maximum. A
    /// sandbox may ask for less than a default, or more, up to the maximum.
    pub fn settle(&self, asked: Limits) -> Result<Limits, LimitsError> {
        let pids = asked.pids.unwrap_or(self.default_pids);
        if pids > self.max_pids {
            return Err(LimitsError::PidsAboveMax { got: pids, max: self.max_pids });
        }
        let memory = asked.memory.or(self.default_memory);
        if let (Some(got), Some(max)) = (memory, self.max_memory) {
            if got > max {
                return Err(LimitsError::MemoryAboveMax { got, max });
            }
        }
        Ok(Limits { pids: Some(pids), memory, ..asked })
    }
}

impl Limits {
    pub fn validate(&self, host_cpus: usize) -> Result<(), LimitsError> {
        if let Some(m) = self.memory {
            if m < MIN_MEMORY {
                return Err(LimitsError::MemoryTooSmall(m));
            }
            if m > MAX_MEMORY {
                return Err(LimitsError::MemoryTooLarge(m));
            }
        }
        match self.pids {
            Some(0) => return Err(LimitsError::PidsZero),
            Some(n) if n > MAX_PIDS => return Err(LimitsError::PidsTooLarge(n)),
            _ => {}
        }
        if let Some(c) = self.cpus {
            let max = host_cpus as f64;
            if !c.is_finite() || !(0.01..=max).contains(&c) {
                return Err(LimitsError::Cpus { got: c, max });
            }
        }
        if let Some(d) = self.disk {
            if !(crate::store::disk::MIN_DISK..=crate::store::disk::MAX_DISK).contains(&d) {
                return Err(LimitsError::Disk(d));
            }
        }
        Ok(())
    }
}

/// The CFS quota (µs per [`CPU_PERIOD_US`]) for a CPU count.
pub fn cpu_quota_us(cpus: f64) -> i64 {
    (cpus * CPU_PERIOD_US as f64).round() as i64
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("create cgroup {path}")]
    Create {
        path: String,
        #[source]
        source: cgroups_rs::error::Error,
    },
    #[error("cgroup {path} was not created in every controller (is {ctrl} mounted and writable?)")]
    Missing { path: String, ctrl: &'static str },
    #[error("set {what} on cgroup {path}")]
    Limit {
        what: &'static str,
        path: String,
        #[source]
        source: cgroups_rs::error::Error,
    },
    #[error("move pid {pid} into cgroup {path}")]
    AddTask {
        pid: u64,
        path: String,
        #[source]
        source: cgroups_rs::error::Error,
    },
    #[error("open cgroup {path}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("remove cgroup {path}: processes {pids:?} are still in it after {waited:?}")]
    Busy { path: String, pids: Vec<u64>, waited: Duration },
    #[error("{what} cgroup {path}")]
    Freezer {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cgroup {path} did not reach the frozen state within {waited:?} (still {state})")]
    FreezeTimeout { path: String, waited: Duration, state: String },
    #[error("restrict the devices of cgroup {path}")]
    Devices {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("remove cgroup {path}")]
    Remove {
        path: String,
        #[source]
        source: cgroups_rs::error::Error,
    },
}

/// A device a sandbox may open: `c` or `b`, major, minor (`None`: any).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRule {
    pub kind: char,
    pub major: u32,
    pub minor: Option<u32>,
}

const fn char_dev(major: u32, minor: Option<u32>) -> DeviceRule {
    DeviceRule { kind: 'c', major, minor }
}

/// The devices a sandbox may use, all others refused (EPERM) by the
/// devices controller (v1) or an eBPF device filter (v2): the shim's
/// minimal `/dev` (null, zero, full, random, urandom, tty) and
/// pseudo-terminals (ptmx 5:2, pts 136:*). A node that reaches a sandbox
/// any other way (a layer cannot carry one; CAP_MKNOD is dropped) cannot be
/// opened.
pub const ALLOWED_DEVICES: [DeviceRule; 8] = [
    char_dev(1, Some(3)),
    char_dev(1, Some(5)),
    char_dev(1, Some(7)),
    char_dev(1, Some(8)),
    char_dev(1, Some(9)),
    char_dev(5, Some(0)),
    char_dev(5, Some(2)),
    char_dev(136, None),
];

/// The cgroup v2 device filter for `rules`: allow (1) a device whose type,
/// major and minor match a rule, refuse (0) any other. The context is
/// `struct bpf_cgroup_dev_ctx { u32 access_type; u32 major; u32 minor; }`,
/// the device type in the low 16 bits of `access_type` (1 block, 2 char).
pub fn device_program(rules: &[DeviceRule]) -> Vec<strata_shim::sys::BpfInsn> {
    use strata_shim::sys::BpfInsn;
    const LDX_W: u8 = 0x61; // BPF_LDX | BPF_MEM | BPF_W
    const AND32_K: u8 = 0x54; // BPF_ALU | BPF_AND | BPF_K
    const JNE_K: u8 = 0x55; // BPF_JMP | BPF_JNE | BPF_K
    const MOV64_K: u8 = 0xb7; // BPF_ALU64 | BPF_MOV | BPF_K
    const EXIT: u8 = 0x95; // BPF_JMP | BPF_EXIT
    let ins = |code, dst: u8, src: u8, off: i16, imm: i32| BpfInsn { code, regs: dst | (src << 4), off, imm };
    let mut p = vec![
        ins(LDX_W, 2, 1, 0, 0),        // r2 = ctx->access_type
        ins(AND32_K, 2, 0, 0, 0xffff), // w2 &= 0xffff: the device type
        ins(LDX_W, 4, 1, 4, 0),        // r4 = ctx->major
        ins(LDX_W, 5, 1, 8, 0),        // r5 = ctx->minor
    ];
    for r in rules {
        let kind = if r.kind == 'b' { 1 } else { 2 };
        // Each rule is a block of checks then "return 1"; a failed check
        // jumps past the block (a jump skips `off` instructions).
        let block = 2 + usize::from(r.minor.is_some()) + 2;
        p.push(ins(JNE_K, 2, 0, (block - 1) as i16, kind));
        p.push(ins(JNE_K, 4, 0, (block - 2) as i16, r.major as i32));
        if let Some(minor) = r.minor {
            p.push(ins(JNE_K, 5, 0, (block - 3) as i16, minor as i32));
        }
        p.push(ins(MOV64_K, 0, 0, 0, 1));
        p.push(ins(EXIT, 0, 0, 0, 0));
    }
    p.push(ins(MOV64_K, 0, 0, 0, 0));
    p.push(ins(EXIT, 0, 0, 0, 0));
    p
}

/// How a new process joins a cgroup ([`SandboxCgroup::join`]).
pub enum Join {
    /// v1: it writes "0" to each of these `tasks` files first thing, while
    /// it is one thread (one thread moving itself takes no global lock).
    Tasks(Vec<std::path::PathBuf>),
    /// v2: `clone3` starts it in this directory (`CLONE_INTO_CGROUP`).
    Dir(std::fs::File),
    /// v2 where that `clone3` cannot be used (not x86_64, a kernel before
    /// 5.7, a seccomp filter refusing `clone3`): moved by pid
    /// ([`SandboxCgroup::add`]).
    ByPid,
}

/// What a cgroup's processes have used: CPU time since it was made, and
/// memory now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub cpu_ns: u64,
    /// Charged memory less the inactive page cache (what `docker stats`
    /// shows; the kernel reclaims that cache first).
    pub memory: u64,
    /// The page cache in it.
    pub memory_cache: u64,
}

/// One sandbox's cgroup.
pub struct SandboxCgroup {
    cg: Cgroup,
    path: String,
}

fn controllers(v2: bool) -> Vec<String> {
    let list: &[&str] =
        if v2 { &["cpu", "memory", "pids"] } else { &["cpu", "cpuacct", "memory", "pids", "freezer", "devices"] };
    list.iter().map(|s| s.to_string()).collect()
}

/// `usage_usec` of a v2 `cpu.stat`.
fn usage_usec(stat: &str) -> u64 {
    stat.lines().find_map(|l| l.strip_prefix("usage_usec ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Is this host on the unified (v2-only) hierarchy?
pub fn is_v2() -> bool {
    cgroups_rs::hierarchies::is_cgroup2_unified_mode()
}

impl SandboxCgroup {
    /// Create `path` (e.g. `strata/0123456789abcdef`) and apply `limits`.
    /// On error nothing is left behind.
    pub fn create(path: &str, limits: &Limits) -> Result<SandboxCgroup, CgroupError> {
        SandboxCgroup::create_with(path, limits, true)
    }

    /// Create (or take, if it exists) `path` for the daemon's own work on
    /// a sandbox's behalf (`crate::worker`) and apply `limits`: no device
    /// rules (the workers are the daemon's code; a hydration makes the
    /// whiteout devices a layer holds).
    pub fn create_work(path: &str, limits: &Limits) -> Result<SandboxCgroup, CgroupError> {
        SandboxCgroup::create_with(path, limits, false)
    }

    /// Create `path`, restrict its devices (if `devices`), apply `limits`;
    /// on error nothing is left behind.
    fn create_with(path: &str, limits: &Limits, devices: bool) -> Result<SandboxCgroup, CgroupError> {
        let hier = cgroups_rs::hierarchies::auto();
        let v2 = hier.v2();
        let cg = Cgroup::new_with_specified_controllers(hier, path, Some(controllers(v2)))
            .map_err(|source| CgroupError::Create { path: path.into(), source })?;
        let this = SandboxCgroup { cg, path: path.to_string() };
        let restricted = if devices { this.restrict_devices() } else { Ok(()) };
        if let Err(e) = restricted.and_then(|()| this.apply(limits)) {
            let _ = this.cg.delete();
            return Err(e);
        }
        Ok(this)
    }

    /// A handle on an existing sandbox cgroup (after a daemon restart).
    pub fn load(path: &str) -> SandboxCgroup {
        let hier = cgroups_rs::hierarchies::auto();
        let v2 = hier.v2();
        let cg = Cgroup::load_with_specified_controllers(hier, path, controllers(v2));
        SandboxCgroup { cg, path: path.to_string() }
    }

    pub fn path(&self) -> &str {
        &self.path
    }

    /// Allow only [`ALLOWED_DEVICES`]: v1 writes the devices controller's
    /// lists (deny all, then allow each), v2 attaches an eBPF filter.
    fn restrict_devices(&self) -> Result<(), CgroupError> {
        let err = |source| CgroupError::Devices { path: self.path.clone(), source };
        if self.cg.v2() {
            let dir = std::fs::File::open(self.v2_dir()).map_err(err)?;
            use std::os::fd::AsFd;
            return strata_shim::sys::attach_device_filter(dir.as_fd(), &device_program(&ALLOWED_DEVICES))
                .map_err(|e| err(e.into()));
        }
        let dir = std::path::Path::new("/sys/fs/cgroup/devices").join(&self.path);
        std::fs::write(dir.join("devices.deny"), "a").map_err(err)?;
        for r in ALLOWED_DEVICES {
            let minor = r.minor.map_or("*".to_string(), |m| m.to_string());
            std::fs::write(dir.join("devices.allow"), format!("{} {}:{minor} rwm", r.kind, r.major)).map_err(err)?;
        }
        Ok(())
    }

    /// Write the limits (only those that are set: a new cgroup has none).
    pub fn apply(&self, limits: &Limits) -> Result<(), CgroupError> {
        self.write(limits, false)
    }

    /// Write every limit, live: one that is unset is lifted (`max`, -1), so
    /// the cgroup holds exactly `limits` afterwards.
    pub fn set(&self, limits: &Limits) -> Result<(), CgroupError> {
        self.write(limits, true)
    }

    fn write(&self, limits: &Limits, lift: bool) -> Result<(), CgroupError> {
        let path = || self.path.clone();
        let mem: &MemController =
            self.cg.controller_of().ok_or(CgroupError::Missing { path: path(), ctrl: "memory" })?;
        let pids: &PidController =
            self.cg.controller_of().ok_or(CgroupError::Missing { path: path(), ctrl: "pids" })?;
        let cpu: &CpuController = self.cg.controller_of().ok_or(CgroupError::Missing { path: path(), ctrl: "cpu" })?;
        if !self.cg.exists() {
            return Err(CgroupError::Missing { path: path(), ctrl: "memory/pids/cpu" });
        }
        // -1 is "max" to cgroups-rs on v2 and no limit in v1's files.
        if let Some(m) = limits.memory.map(|m| m as i64).or(lift.then_some(-1)) {
            mem.set_limit(m).map_err(|source| CgroupError::Limit { what: "memory limit", path: path(), source })?;
        }
        let pid_max = limits.pids.map(|n| MaxValue::Value(n as i64)).or(lift.then_some(MaxValue::Max));
        if let Some(n) = pid_max {
            pids.set_pid_max(n).map_err(|source| CgroupError::Limit { what: "pids limit", path: path(), source })?;
        }
        if let Some(q) = limits.cpus.map(cpu_quota_us).or(lift.then_some(-1)) {
            cpu.set_cfs_quota_and_period(Some(q), Some(CPU_PERIOD_US)).map_err(|source| CgroupError::Limit {
                what: "cpu quota",
                path: path(),
                source,
            })?;
        }
        Ok(())
    }

    /// Freeze every process of the cgroup and wait until the kernel reports
    /// it frozen (v1 `freezer.state` FROZEN, v2 `cgroup.events` frozen 1).
    pub fn freeze(&self, budget: Duration) -> Result<(), CgroupError> {
        self.set_frozen(true)?;
        let start = Instant::now();
        loop {
            let state = self.frozen_state()?;
            if state == "frozen" {
                return Ok(());
            }
            if start.elapsed() > budget {
                let _ = self.set_frozen(false);
                return Err(CgroupError::FreezeTimeout { path: self.path.clone(), waited: budget, state });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.set_frozen(false)
    }

    /// The v2 directory of this cgroup (v2 has one hierarchy).
    fn v2_dir(&self) -> std::path::PathBuf {
        std::path::Path::new(cgroups_rs::hierarchies::UNIFIED_MOUNTPOINT).join(&self.path)
    }

    fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        let what = if frozen { "freeze" } else { "thaw" };
        let err = |source| CgroupError::Freezer { what, path: self.path.clone(), source };
        if self.cg.v2() {
            return std::fs::write(self.v2_dir().join("cgroup.freeze"), if frozen { "1" } else { "0" }).map_err(err);
        }
        let f: &cgroups_rs::freezer::FreezerController =
            self.cg.controller_of().ok_or(CgroupError::Missing { path: self.path.clone(), ctrl: "freezer" })?;
        let r = if frozen { f.freeze() } else { f.thaw() };
        r.map_err(|e| err(std::io::Error::other(e.to_string())))
    }

    /// "frozen", "freezing" or "thawed".
    fn frozen_state(&self) -> Result<String, CgroupError> {
        let err = |source| CgroupError::Freezer { what: "read state of", path: self.path.clone(), source };
        if self.cg.v2() {
            let events = std::fs::read_to_string(self.v2_dir().join("cgroup.events")).map_err(err)?;
            let frozen = events.lines().any(|l| l.trim() == "frozen 1");
            return Ok(if frozen { "frozen" } else { "freezing" }.into());
        }
        let f: &cgroups_rs::freezer::FreezerController =
            self.cg.controller_of().ok_or(CgroupError::Missing { path: self.path.clone(), ctrl: "freezer" })?;
        Ok(match f.state() {
            Ok(cgroups_rs::freezer::FreezerState::Frozen) => "frozen",
            Ok(cgroups_rs::freezer::FreezerState::Freezing) => "freezing",
            Ok(cgroups_rs::freezer::FreezerState::Thawed) => "thawed",
            Err(e) => return Err(err(std::io::Error::other(e.to_string()))),
        }
        .into())
    }

    /// The `tasks` files through which a process can join this cgroup
    /// itself, in every controller (v1); none on v2. See
    /// `SpawnPlan::cgroup_tasks` for why a shim (and a capture worker)
    /// joins by itself.
    fn tasks_files(&self) -> Vec<std::path::PathBuf> {
        if self.cg.v2() {
            return Vec::new();
        }
        let mut dirs: Vec<&std::path::Path> = self.cg.subsystems().iter().map(|s| s.to_controller().path()).collect();
        // cpu and cpuacct are often one hierarchy.
        dirs.sort();
        dirs.dedup();
        dirs.into_iter().map(|d| d.join("tasks")).collect()
    }

    /// How a process we start gets into this cgroup: born there wherever
    /// it can be, rather than moved by pid (which takes the kernel's global
    /// threadgroup lock for writing: an RCU grace period, 7-15 ms, on a
    /// host idle just before).
    pub fn join(&self) -> Result<Join, CgroupError> {
        Ok(if !self.cg.v2() {
            Join::Tasks(self.tasks_files())
        } else if strata_shim::sys::can_clone_into_cgroup() {
            let dir = std::fs::File::open(self.v2_dir());
            Join::Dir(dir.map_err(|source| CgroupError::Open { path: self.path.clone(), source })?)
        } else {
            Join::ByPid
        })
    }

    pub fn add(&self, pid: u32) -> Result<(), CgroupError> {
        self.cg.add_task_by_tgid(CgroupPid::from(pid as u64)).map_err(|source| CgroupError::AddTask {
            pid: pid as u64,
            path: self.path.clone(),
            source,
        })
    }

    pub fn procs(&self) -> Vec<u64> {
        self.cg.procs().into_iter().map(|p| p.pid).collect()
    }

    /// Its CPU time and memory (zeros for a controller it lacks). v1:
    /// `cpuacct.usage`, `memory.usage_in_bytes` and the hierarchical
    /// `total_*` of `memory.stat`; v2: `cpu.stat`'s `usage_usec`,
    /// `memory.current` and `memory.stat`.
    pub fn usage(&self) -> Usage {
        let v2 = self.cg.v2();
        let cpu_ns = if v2 {
            self.cg.controller_of::<CpuController>().map_or(0, |c| usage_usec(&c.cpu().stat) * 1000)
        } else {
            self.cg.controller_of::<CpuAcctController>().map_or(0, |c| c.cpuacct().usage)
        };
        let (memory, memory_cache) = self.cg.controller_of::<MemController>().map_or((0, 0), |m| {
            let m = m.memory_stat();
            let stat = |k: &str| m.stat.raw.get(k).copied().unwrap_or(0);
            let (inactive, cache) = if v2 {
                (stat("inactive_file"), stat("file"))
            } else {
                (stat("total_inactive_file"), stat("total_cache"))
            };
            (m.usage_in_bytes.saturating_sub(inactive), cache)
        });
        Usage { cpu_ns, memory, memory_cache }
    }

    /// Remove the cgroup once its processes are gone. Killed processes take a
    /// moment to leave (they must be reaped first), so wait up to `budget`.
    pub fn remove(&self, budget: Duration) -> Result<(), CgroupError> {
        self.remove_with(budget, false)
    }

    /// [`SandboxCgroup::remove`], killing (SIGKILL) whatever is in the
    /// cgroup at every look, not once: a process that joins it by itself
    /// (a capture worker on v1) may come in after the first.
    pub fn kill_and_remove(&self, budget: Duration) -> Result<(), CgroupError> {
        self.remove_with(budget, true)
    }

    fn remove_with(&self, budget: Duration, kill: bool) -> Result<(), CgroupError> {
        let start = Instant::now();
        loop {
            if !self.cg.exists() {
                return Ok(());
            }
            let pids = self.procs();
            if kill {
                for &pid in &pids {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            if pids.is_empty() {
                match self.cg.delete() {
                    Ok(()) => return Ok(()),
                    Err(source) if start.elapsed() > budget => {
                        return Err(CgroupError::Remove { path: self.path.clone(), source })
                    }
                    Err(_) => {}
                }
            } else if start.elapsed() > budget {
                return Err(CgroupError::Busy { path: self.path.clone(), pids, waited: budget });
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_cpu_stat_gives_its_usage() {
        assert_eq!(usage_usec("usage_usec 1234\nuser_usec 1000\nsystem_usec 234\n"), 1234);
        assert_eq!(usage_usec("user_usec 1000\n"), 0);
    }

    #[test]
    fn cpu_quota_is_per_period() {
        assert_eq!(cpu_quota_us(0.5), 50_000);
        assert_eq!(cpu_quota_us(1.0), 100_000);
        assert_eq!(cpu_quota_us(1.5), 150_000);
        assert_eq!(cpu_quota_us(0.01), 1_000);
    }

    #[test]
    fn limits_are_validated() {
        assert!(Limits::default().validate(2).is_ok());
        let l = Limits { memory: Some(1024), ..Default::default() };
        assert_eq!(l.validate(2), Err(LimitsError::MemoryTooSmall(1024)));
        let l = Limits { pids: Some(0), ..Default::default() };
        assert_eq!(l.validate(2), Err(LimitsError::PidsZero));
        for bad in [0.0, -1.0, 3.0, f64::NAN, f64::INFINITY] {
            let l = Limits { cpus: Some(bad), ..Default::default() };
            assert!(l.validate(2).is_err(), "{bad}");
        }
        let l = Limits { memory: Some(u64::MAX), ..Default::default() };
        assert_eq!(l.validate(2), Err(LimitsError::MemoryTooLarge(u64::MAX)));
        let l = Limits { pids: Some(MAX_PIDS + 1), ..Default::default() };
        assert_eq!(l.validate(2), Err(LimitsError::PidsTooLarge(MAX_PIDS + 1)));
        for bad in [0, crate::store::disk::MIN_DISK - 1, crate::store::disk::MAX_DISK + 1] {
            let l = Limits { disk: Some(bad), ..Default::default() };
            assert_eq!(l.validate(2), Err(LimitsError::Disk(bad)));
        }
        let l = Limits {
            memory: Some(MIN_MEMORY),
            pids: Some(1),
            cpus: Some(2.0),
            disk: Some(crate::store::disk::MIN_DISK),
        };
        assert!(l.validate(2).is_ok());
    }

    #[test]
    fn a_policy_that_contradicts_itself_is_refused() {
        assert_eq!(LimitPolicy::default().check(), Ok(()));
        let p = LimitPolicy { default_pids: 10, max_pids: 5, ..Default::default() };
        assert_eq!(p.check(), Err(PolicyError::Pids { default: 10, max: 5 }));
        let p = LimitPolicy { default_memory: Some(2 << 30), max_memory: Some(1 << 30), ..Default::default() };
        assert_eq!(p.check(), Err(PolicyError::Memory { default: 2 << 30, max: 1 << 30 }));
        let p = LimitPolicy { max_memory: Some(1024), ..Default::default() };
        assert_eq!(p.check(), Err(PolicyError::MemoryTooSmall { flag: "--max-memory", value: 1024 }));
        assert_eq!(
            p.check().unwrap_err().to_string(),
            format!("--max-memory 1024 is below the minimum of {MIN_MEMORY} bytes")
        );
    }

    #[test]
    fn defaults_fill_in_and_maximums_refuse() {
        let p = LimitPolicy {
            default_pids: 2048,
            max_pids: 4096,
            default_memory: Some(1 << 30),
            max_memory: Some(2 << 30),
        };
        let l = p.settle(Limits::default()).unwrap();
        assert_eq!((l.pids, l.memory), (Some(2048), Some(1 << 30)));
        let l = p.settle(Limits { pids: Some(16), memory: Some(64 << 20), ..Default::default() }).unwrap();
        assert_eq!((l.pids, l.memory), (Some(16), Some(64 << 20)), "lower than the defaults");
        let l = p.settle(Limits { pids: Some(4096), memory: Some(2 << 30), ..Default::default() }).unwrap();
        assert_eq!((l.pids, l.memory), (Some(4096), Some(2 << 30)), "raised up to the maximums");
        let e = p.settle(Limits { pids: Some(4097), ..Default::default() }).unwrap_err();
        assert_eq!(e, LimitsError::PidsAboveMax { got: 4097, max: 4096 });
        let e = p.settle(Limits { memory: Some((2 << 30) + 1), ..Default::default() }).unwrap_err();
        assert_eq!(e, LimitsError::MemoryAboveMax { got: (2 << 30) + 1, max: 2 << 30 });
        // The built-in policy: podman's 2048 pids, no memory limit.
        let l = LimitPolicy::default().settle(Limits::default()).unwrap();
        assert_eq!((l.pids, l.memory), (Some(DEFAULT_PIDS), None));
    }

    #[test]
    fn the_device_program_allows_the_listed_devices_only() {
        // A tiny interpreter of the instructions device_program emits.
        let p = device_program(&ALLOWED_DEVICES);
        let run = |kind: u32, major: u32, minor: u32| -> i64 {
            let ctx = [(2u32 << 16) | kind, major, minor];
            let mut r = [0i64; 11];
            let mut pc = 0usize;
            loop {
                let i = p[pc];
                let (dst, src) = ((i.regs & 0xf) as usize, (i.regs >> 4) as usize);
                assert_eq!(src == 1, i.code == 0x61, "only loads read r1");
                match i.code {
                    0x61 => r[dst] = ctx[i.off as usize / 4] as i64,
                    0x54 => r[dst] &= i.imm as i64,
                    0x55 if r[dst] != i.imm as i64 => pc += i.off as usize,
                    0x55 => {}
                    0xb7 => r[dst] = i.imm as i64,
                    0x95 => return r[0],
                    c => panic!("unexpected opcode {c:#x}"),
                }
                pc += 1;
            }
        };
        assert_eq!(run(2, 1, 3), 1, "/dev/null");
        assert_eq!(run(2, 1, 9), 1, "/dev/urandom");
        assert_eq!(run(2, 136, 7), 1, "a pty");
        assert_eq!(run(2, 5, 2), 1, "ptmx");
        assert_eq!(run(2, 1, 11), 0, "kmsg");
        assert_eq!(run(2, 1, 1), 0, "/dev/mem");
        assert_eq!(run(1, 8, 0), 0, "a disk");
        assert_eq!(run(1, 1, 3), 0, "a block device 1:3");
        assert_eq!(run(2, 4, 0), 0, "tty0");
    }

    #[test]
    fn controller_sets() {
        assert!(!controllers(true).contains(&"freezer".to_string()), "v2 freezes via cgroup.freeze");
        assert!(controllers(false).contains(&"freezer".to_string()));
    }
}
