//! Process-wide memo of layout conversions. A `LayoutContext` is one
//! (mesh link model, global shape, dtype size); it caches the optimal path of
//! every (source, target) pair asked for. Contexts are interned in a global
//! registry, so the ILP, the explainer and the runtime all share one cache.
//!
//! A path is always the single-pair search's (`optimal_path`), a pure function
//! of the pair: where several paths cost the same, the one-to-many search of a
//! cost matrix may settle on another, so its results are kept as costs only.
//! Otherwise a rank that planned (and filled its cache from matrices) would run
//! other collectives than a rank that did not.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use rustc_hash::FxHashMap;

use super::moves::{LayoutPath, LayoutProblem};
use super::search::{optimal_path, optimal_paths_from};
use crate::error::{limit_exceeded, Result};
use crate::sharding::enumerate::count_specs;
use crate::sharding::mesh::DeviceMesh;
use crate::sharding::spec::ShardingSpec;

/// Cost matrices run one Dijkstra per row (it settles every target at once)
/// when the tensor has at most this many specs; above it, one A* per missing
/// pair: the goal-directed search visits a few hundred specs where a
/// Dijkstra would visit most of the space (on eight mesh axes a 2-D tensor has
/// 634 889 specs: 10 rows took 10.6 s by Dijkstra, 2 500 pairs 0.27 s by A*).
pub const DIJKSTRA_MAX_SPECS: usize = 20_000;

/// Most entries of one cost matrix (two f64 per entry: 1 GiB).
pub const MAX_MATRIX_CELLS: usize = 1 << 26;

pub struct LayoutContext {
    problem: LayoutProblem,
    paths: Mutex<FxHashMap<(u64, u64), Arc<LayoutPath>>>,
    /// (forward, backward) seconds of pairs a cost matrix searched.
    costs: Mutex<FxHashMap<(u64, u64), (f64, f64)>>,
    /// Whether the tensor has few enough specs for row-wise Dijkstra.
    small_space: OnceLock<bool>,
}

/// Forward and backward seconds of every (source, target) pair, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct CostMatrix {
    pub rows: usize,
    pub cols: usize,
    pub forward_s: Vec<f64>,
    pub backward_s: Vec<f64>,
}

static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);

/// A lock whose holder panicked still guards a consistent map (entries are
/// inserted whole), so poisoning is ignored.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LayoutContext {
    pub fn new(problem: LayoutProblem) -> LayoutContext {
        LayoutContext {
            problem,
            paths: Mutex::new(FxHashMap::default()),
            costs: Mutex::new(FxHashMap::default()),
            small_space: OnceLock::new(),
        }
    }

    pub fn problem(&self) -> &LayoutProblem {
        &self.problem
    }

    /// The cached path if this pair was searched before (both specs must be
    /// valid for this context: the key holds the axes, not the rank).
    #[inline]
    fn cached(&self, src: &ShardingSpec, dst: &ShardingSpec) -> Option<Arc<LayoutPath>> {
        let found = lock(&self.paths).get(&(src.key(), dst.key())).cloned();
        if found.is_some() {
            HITS.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// The optimal path from `src` to `dst`, searched once per pair.
    pub fn path(&self, src: &ShardingSpec, dst: &ShardingSpec) -> Result<Arc<LayoutPath>> {
        self.problem.validate(src)?;
        self.problem.validate(dst)?;
        if let Some(p) = self.cached(src, dst) {
            return Ok(p);
        }
        MISSES.fetch_add(1, Ordering::Relaxed);
        let path = Arc::new(optimal_path(&self.problem, *src, *dst)?);
        lock(&self.paths).insert((src.key(), dst.key()), path.clone());
        Ok(path)
    }

    pub(crate) fn small_space(&self) -> Result<bool> {
        if let Some(&small) = self.small_space.get() {
            return Ok(small);
        }
        let p = &self.problem;
        let small = count_specs(p.shape(), &p.mesh_shape, DIJKSTRA_MAX_SPECS)?.is_some();
        Ok(*self.small_space.get_or_init(|| small))
    }

    /// Costs of converting every spec of `srcs` into every spec of `dsts`.
    /// Cached pairs are read under one lock; the misses of a row are one
    /// single-source search (small spec spaces, kept as costs) or one A* each
    /// (kept as the pair's path).
    pub fn cost_matrix(&self, srcs: &[ShardingSpec], dsts: &[ShardingSpec]) -> Result<CostMatrix> {
        for spec in srcs.iter().chain(dsts) {
            self.problem.validate(spec)?;
        }
        let (rows, cols) = (srcs.len(), dsts.len());
        let cells = match rows.checked_mul(cols) {
            Some(n) if n <= MAX_MATRIX_CELLS => n,
            _ => {
                return limit_exceeded(format!(
                    "a {rows} x {cols} cost matrix has more than {MAX_MATRIX_CELLS} entries \
                     (the cap, 1 GiB of costs)"
                ))
            }
        };
        let mut m = CostMatrix {
            rows,
            cols,
            forward_s: vec![f64::NAN; cells],
            backward_s: vec![f64::NAN; cells],
        };
        let mut missing_rows = Vec::new();
        {
            let paths = lock(&self.paths);
            let costs = lock(&self.costs);
            let mut hits = 0;
            for (i, s) in srcs.iter().enumerate() {
                let mut row_misses = false;
                for (j, d) in dsts.iter().enumerate() {
                    let key = (s.key(), d.key());
                    let found = match paths.get(&key) {
                        Some(p) => Some((p.forward_cost_s, p.backward_cost_s)),
                        None => costs.get(&key).copied(),
                    };
                    if let Some((fwd, bwd)) = found {
                        m.forward_s[i * cols + j] = fwd;
                        m.backward_s[i * cols + j] = bwd;
                        hits += 1;
                    } else {
                        row_misses = true;
                    }
                }
                if row_misses {
                    missing_rows.push(i);
                }
            }
            HITS.fetch_add(hits, Ordering::Relaxed);
        }
        let row_wise = missing_rows.is_empty() || self.small_space()?;
        for i in missing_rows {
            let src = srcs[i];
            let row = i * cols..(i + 1) * cols;
            let mut missing: Vec<ShardingSpec> = dsts
                .iter()
                .zip(&m.forward_s[row])
                .filter(|(_, f)| f.is_nan())
                .map(|(d, _)| *d)
                .collect();
            missing.sort_unstable_by_key(|d| d.key());
            missing.dedup();
            MISSES.fetch_add(missing.len() as u64, Ordering::Relaxed);
            let found: Vec<LayoutPath> = if row_wise {
                optimal_paths_from(&self.problem, src, &missing)?
            } else {
                missing
                    .iter()
                    .map(|&d| optimal_path(&self.problem, src, d))
                    .collect::<Result<_>>()?
            };
            for path in found {
                let (dst, fwd, bwd) = (path.dst, path.forward_cost_s, path.backward_cost_s);
                if row_wise {
                    lock(&self.costs).insert((src.key(), dst.key()), (fwd, bwd));
                } else {
                    // A single-pair search's path: the pair's path as `path` gives it.
                    lock(&self.paths).insert((src.key(), dst.key()), Arc::new(path));
                }
                for (j, d) in dsts.iter().enumerate() {
                    if *d == dst {
                        m.forward_s[i * cols + j] = fwd;
                        m.backward_s[i * cols + j] = bwd;
                    }
                }
            }
        }
        Ok(m)
    }

    pub fn len(&self) -> usize {
        lock(&self.paths).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Identity of a context: exact link parameters (as bits), shape and dtype.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ContextKey {
    mesh_shape: Vec<usize>,
    alpha_bits: Vec<u64>,
    bandwidth_bits: Vec<u64>,
    shape: Vec<usize>,
    dtype_bytes: usize,
}

type Registry = Mutex<FxHashMap<ContextKey, Arc<LayoutContext>>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| Mutex::new(FxHashMap::default()))
}

/// The shared context of (mesh, shape, dtype size), created on first use.
pub fn layout_context(
    mesh: &DeviceMesh,
    shape: &[usize],
    dtype_bytes: usize,
) -> Result<Arc<LayoutContext>> {
    let key = ContextKey {
        mesh_shape: mesh.shape().to_vec(),
        alpha_bits: mesh.alpha_s().iter().map(|x| x.to_bits()).collect(),
        bandwidth_bits: mesh
            .bandwidth_bytes_per_s()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        shape: shape.to_vec(),
        dtype_bytes,
    };
    if let Some(ctx) = lock(registry()).get(&key) {
        return Ok(ctx.clone());
    }
    let problem = LayoutProblem::new(mesh, shape, dtype_bytes)?;
    Ok(lock(registry())
        .entry(key)
        .or_insert_with(|| Arc::new(LayoutContext::new(problem)))
        .clone())
}

/// (cache hits, searches) since start or the last `clear_layout_cache`.
pub fn cache_stats() -> (u64, u64) {
    (HITS.load(Ordering::Relaxed), MISSES.load(Ordering::Relaxed))
}

/// Forget every cached path (benchmarks and tests).
pub fn clear_layout_cache() {
    lock(registry()).clear();
    HITS.store(0, Ordering::Relaxed);
    MISSES.store(0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contexts_are_shared_and_paths_cached() {
        let mesh = DeviceMesh::uniform(vec![2, 2], 1e-5, 1e9).unwrap();
        let a = layout_context(&mesh, &[8, 8], 4).unwrap();
        let b = layout_context(&mesh, &[8, 8], 4).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let other = layout_context(&mesh, &[8, 8], 2).unwrap();
        assert!(!Arc::ptr_eq(&a, &other));
        let s = ShardingSpec::parse("S0S1").unwrap();
        let d = ShardingSpec::parse("S10R").unwrap();
        let p1 = a.path(&s, &d).unwrap();
        let p2 = b.path(&s, &d).unwrap();
        assert!(Arc::ptr_eq(&p1, &p2));
        let bad = ShardingSpec::parse("S01S1").unwrap_or(s);
        assert!(a
            .path(&ShardingSpec::parse("S012R").unwrap(), &bad)
            .is_err());
    }

    #[test]
    fn paths_do_not_depend_on_the_matrices_searched_before() {
        // Near-zero latencies: many conversions have several paths of equal cost.
        let mesh = DeviceMesh::new(vec![2, 2], None, vec![1e-8; 2], vec![1e9, 1e11]).unwrap();
        let shape = [8, 8, 4];
        let ctx = layout_context(&mesh, &shape, 4).unwrap();
        let specs = crate::sharding::enumerate::enumerate_specs(&shape, mesh.shape()).unwrap();
        let m = ctx.cost_matrix(&specs, &specs).unwrap();
        let problem = LayoutProblem::new(&mesh, &shape, 4).unwrap();
        for (i, s) in specs.iter().enumerate() {
            for (j, d) in specs.iter().enumerate() {
                let fresh = optimal_path(&problem, *s, *d).unwrap();
                let cached = ctx.path(s, d).unwrap();
                assert_eq!(cached.steps, fresh.steps, "{s} -> {d}");
                let total = m.forward_s[i * specs.len() + j] + m.backward_s[i * specs.len() + j];
                assert!((total - fresh.cost_s()).abs() <= 1e-12 * fresh.cost_s().max(1e-9));
            }
        }
    }

    fn specs(texts: &[&str]) -> Vec<ShardingSpec> {
        texts
            .iter()
            .map(|s| ShardingSpec::parse(s).unwrap())
            .collect()
    }

    /// The matrix of `ctx` agrees with single-pair searches in a fresh context.
    fn assert_matrix_matches_paths(ctx: &LayoutContext, specs: &[ShardingSpec]) -> CostMatrix {
        let m = ctx.cost_matrix(specs, specs).unwrap();
        let fresh = LayoutContext::new(ctx.problem().clone());
        let n = specs.len();
        for (i, s) in specs.iter().enumerate() {
            for (j, d) in specs.iter().enumerate() {
                let p = fresh.path(s, d).unwrap();
                let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b.abs().max(1e-9);
                assert!(
                    close(m.forward_s[i * n + j], p.forward_cost_s),
                    "{s} -> {d}"
                );
                assert!(
                    close(m.backward_s[i * n + j], p.backward_cost_s),
                    "{s} -> {d}"
                );
            }
        }
        m
    }

    #[test]
    fn cost_matrix_matches_single_paths() {
        let mesh = DeviceMesh::uniform(vec![4], 1e-5, 1e9).unwrap();
        let ctx = layout_context(&mesh, &[16, 4], 4).unwrap();
        let m = assert_matrix_matches_paths(&ctx, &specs(&["RR", "S0R", "RS0"]));
        assert_eq!(m.forward_s[0], 0.0);
    }

    #[test]
    fn specs_are_validated_before_the_cache_is_read() {
        // "RRR" and "RRRR" have the same axes (none), so the same cache key:
        // the rank check must come first.
        let mesh = DeviceMesh::uniform(vec![2, 2], 1e-5, 1e9).unwrap();
        let ctx = layout_context(&mesh, &[8, 8, 8], 4).unwrap();
        let rrr = ShardingSpec::parse("RRR").unwrap();
        let rrrr = ShardingSpec::parse("RRRR").unwrap();
        ctx.path(&rrr, &rrr).unwrap();
        let e = ctx.path(&rrrr, &rrr).unwrap_err();
        assert!(e.to_string().contains("4 dims"), "{e}");
        ctx.cost_matrix(&[rrr], &[rrr]).unwrap();
        assert!(ctx.cost_matrix(&[rrrr], &[rrr]).is_err());
        assert!(ctx.cost_matrix(&[rrr], &[rrrr]).is_err());
    }

    #[test]
    fn large_spec_spaces_use_one_search_per_pair() {
        // 634 889 specs: row-wise Dijkstra would take seconds per row.
        let mesh = DeviceMesh::uniform(vec![2; 8], 1e-5, 1e9).unwrap();
        let ctx = layout_context(&mesh, &[64, 64], 4).unwrap();
        assert!(!ctx.small_space().unwrap());
        let chosen = specs(&["S0123S4567", "S765432S10", "RS012345", "S01S23", "RR"]);
        assert_matrix_matches_paths(&ctx, &chosen);
    }
}
