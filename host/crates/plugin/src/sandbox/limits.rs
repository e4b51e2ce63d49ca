//! What one instance may hold: the total of its memories and table elements, and the
//! counts of core instances, memories, tables and host resources, enforced as it grows.

/// What an instance may hold besides its linear memories' bytes. A plain Rust
/// `wasm32-wasip2` policy instantiates 3 core modules (its own and two small shims that
/// `wasm-component-ld` adds), with 1 memory and 2 tables between them (counted in the
/// built fixtures and shipped policies; `plugin::tests::a_normal_policy_fits_the_counts`
/// instantiates them under these limits). The limits leave room for another toolchain's
/// adapters, not for a plugin that multiplies memories or instances.
pub(crate) const MAX_CORE_INSTANCES: usize = 16;
pub(crate) const MAX_MEMORIES: usize = 4;
pub(crate) const MAX_TABLES: usize = 8;
/// Table elements over all tables of an instance (a funcref costs the host about 8 to
/// 16 bytes): a Rust policy's function table has a few hundred to a few thousand.
pub(crate) const MAX_TABLE_ELEMENTS: usize = 100_000;
/// Host resources (WASI streams, pollables, …) one instance may hold at once. wasmtime's
/// own default is about a million, and each one costs host memory that the memory limit
/// does not see, so a guest leaking handles could grow the agent; a policy needs a few.
pub(crate) const MAX_HOST_RESOURCES: usize = 1024;

/// Which limit a failed call ran into, so the trap can be named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LimitHit {
    Memory,
    Table,
}

/// Enforces the instance's limits: the total of all its linear memories (not each one),
/// the total of its table elements, and the counts of core instances, memories and
/// tables. Growth past a limit traps at once rather than handing the guest a failed
/// `memory.grow` it may ignore (what `StoreLimitsBuilder::trap_on_grow_failure` does),
/// and the hit is remembered so the failure is named.
#[derive(Debug)]
pub(crate) struct InstanceLimiter {
    pub(crate) memory_limit_bytes: usize,
    pub(crate) memory_bytes: usize,
    pub(crate) table_elements: usize,
    /// The last growth allowed, undone if the grow then fails in the engine.
    pub(crate) pending_memory: usize,
    pub(crate) pending_table: usize,
    pub(crate) hit: Option<LimitHit>,
}

impl InstanceLimiter {
    pub(crate) fn new(memory_limit_bytes: usize) -> Self {
        Self {
            memory_limit_bytes,
            memory_bytes: 0,
            table_elements: 0,
            pending_memory: 0,
            pending_table: 0,
            hit: None,
        }
    }

    pub(crate) fn hit(&self) -> Option<LimitHit> {
        self.hit
    }
}

impl wasmtime::ResourceLimiter for InstanceLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            // Past the memory's own declared maximum: a plain failed grow, as in any engine.
            return Ok(false);
        }
        let added = desired.saturating_sub(current);
        let total = self.memory_bytes.saturating_add(added);
        if total > self.memory_limit_bytes {
            self.hit = Some(LimitHit::Memory);
            return Err(wasmtime::Error::msg(format!(
                "memory limit: growing the instance's memories to {total} bytes exceeds {} bytes",
                self.memory_limit_bytes
            )));
        }
        self.memory_bytes = total;
        self.pending_memory = added;
        Ok(true)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.memory_bytes = self.memory_bytes.saturating_sub(self.pending_memory);
        self.pending_memory = 0;
        Err(error.context("growing a linear memory failed"))
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if maximum.is_some_and(|max| desired > max) {
            return Ok(false);
        }
        let added = desired.saturating_sub(current);
        let total = self.table_elements.saturating_add(added);
        if total > MAX_TABLE_ELEMENTS {
            self.hit = Some(LimitHit::Table);
            return Err(wasmtime::Error::msg(format!(
                "table limit: growing the instance's tables to {total} elements exceeds {MAX_TABLE_ELEMENTS}"
            )));
        }
        self.table_elements = total;
        self.pending_table = added;
        Ok(true)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.table_elements = self.table_elements.saturating_sub(self.pending_table);
        self.pending_table = 0;
        Err(error.context("growing a table failed"))
    }

    fn instances(&self) -> usize {
        MAX_CORE_INSTANCES
    }

    fn tables(&self) -> usize {
        MAX_TABLES
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES
    }
}
