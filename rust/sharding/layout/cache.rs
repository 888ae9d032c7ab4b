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
use std::sync::{Arc, Mutex, OnceLock};

use rustc_hash::FxHashMap;

use super::moves::{LayoutPath, LayoutProblem};
use super::search::{optimal_path, optimal_paths_from};
use crate::error::Result;
use crate::sharding::mesh::DeviceMesh;
use crate::sharding::spec::ShardingSpec;

pub struct LayoutContext {
    problem: LayoutProblem,
    paths: Mutex<FxHashMap<(u64, u64), Arc<LayoutPath>>>,
    /// (forward, backward) seconds of pairs a cost matrix searched.
    costs: Mutex<FxHashMap<(u64, u64), (f64, f64)>>,
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

impl LayoutContext {
    pub fn new(problem: LayoutProblem) -> LayoutContext {
        LayoutContext {
            problem,
            paths: Mutex::new(FxHashMap::default()),
            costs: Mutex::new(FxHashMap::default()),
        }
    }

    pub fn problem(&self) -> &LayoutProblem {
        &self.problem
    }

    /// The cached path if this pair was searched before.
    #[inline]
    pub fn cached(&self, src: &ShardingSpec, dst: &ShardingSpec) -> Option<Arc<LayoutPath>> {
        let found = self
            .paths
            .lock()
            .unwrap()
            .get(&(src.key(), dst.key()))
            .cloned();
        if found.is_some() {
            HITS.fetch_add(1, Ordering::Relaxed);
        }
        found
    }

    /// The optimal path from `src` to `dst`, searched once per pair.
    pub fn path(&self, src: &ShardingSpec, dst: &ShardingSpec) -> Result<Arc<LayoutPath>> {
        if let Some(p) = self.cached(src, dst) {
            return Ok(p);
        }
        self.problem.validate(src)?;
        self.problem.validate(dst)?;
        MISSES.fetch_add(1, Ordering::Relaxed);
        let path = Arc::new(optimal_path(&self.problem, *src, *dst));
        self.paths
            .lock()
            .unwrap()
            .insert((src.key(), dst.key()), path.clone());
        Ok(path)
    }

    /// Costs of converting every spec of `srcs` into every spec of `dsts`.
    /// Cached pairs are read under one lock; each row with misses is one
    /// single-source search over all its missing targets.
    pub fn cost_matrix(&self, srcs: &[ShardingSpec], dsts: &[ShardingSpec]) -> Result<CostMatrix> {
        let (rows, cols) = (srcs.len(), dsts.len());
        let mut m = CostMatrix {
            rows,
            cols,
            forward_s: vec![f64::NAN; rows * cols],
            backward_s: vec![f64::NAN; rows * cols],
        };
        let mut missing_rows = Vec::new();
        {
            let paths = self.paths.lock().unwrap();
            let costs = self.costs.lock().unwrap();
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
        for i in missing_rows {
            let src = srcs[i];
            let row = i * cols..(i + 1) * cols;
            let mut missing: Vec<ShardingSpec> = dsts
                .iter()
                .zip(&m.forward_s[row.clone()])
                .filter(|(_, f)| f.is_nan())
                .map(|(d, _)| *d)
                .collect();
            missing.sort_unstable_by_key(|d| d.key());
            missing.dedup();
            self.problem.validate(&src)?;
            for d in &missing {
                self.problem.validate(d)?;
            }
            MISSES.fetch_add(missing.len() as u64, Ordering::Relaxed);
            let paths = optimal_paths_from(&self.problem, src, &missing);
            let mut costs = self.costs.lock().unwrap();
            for path in paths {
                let (dst, fwd, bwd) = (path.dst, path.forward_cost_s, path.backward_cost_s);
                costs.insert((src.key(), dst.key()), (fwd, bwd));
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
        self.paths.lock().unwrap().len()
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
) -> Arc<LayoutContext> {
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
    let mut reg = registry().lock().unwrap();
    reg.entry(key)
        .or_insert_with(|| {
            Arc::new(LayoutContext::new(LayoutProblem::new(
                mesh,
                shape,
                dtype_bytes,
            )))
        })
        .clone()
}

/// (cache hits, searches) since start or the last `clear_layout_cache`.
pub fn cache_stats() -> (u64, u64) {
    (HITS.load(Ordering::Relaxed), MISSES.load(Ordering::Relaxed))
}

/// Forget every cached path (benchmarks and tests).
pub fn clear_layout_cache() {
    registry().lock().unwrap().clear();
    HITS.store(0, Ordering::Relaxed);
    MISSES.store(0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contexts_are_shared_and_paths_cached() {
        let mesh = DeviceMesh::uniform(vec![2, 2], 1e-5, 1e9).unwrap();
        let a = layout_context(&mesh, &[8, 8], 4);
        let b = layout_context(&mesh, &[8, 8], 4);
        assert!(Arc::ptr_eq(&a, &b));
        let other = layout_context(&mesh, &[8, 8], 2);
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
        let ctx = layout_context(&mesh, &shape, 4);
        let specs = crate::sharding::enumerate::enumerate_specs(&shape, mesh.shape());
        let m = ctx.cost_matrix(&specs, &specs).unwrap();
        let problem = LayoutProblem::new(&mesh, &shape, 4);
        for (i, s) in specs.iter().enumerate() {
            for (j, d) in specs.iter().enumerate() {
                let fresh = optimal_path(&problem, *s, *d);
                let cached = ctx.path(s, d).unwrap();
                assert_eq!(cached.steps, fresh.steps, "{s} -> {d}");
                let total = m.forward_s[i * specs.len() + j] + m.backward_s[i * specs.len() + j];
                assert!((total - fresh.cost_s()).abs() <= 1e-12 * fresh.cost_s().max(1e-9));
            }
        }
    }

    #[test]
    fn cost_matrix_matches_single_paths() {
        let mesh = DeviceMesh::uniform(vec![4], 1e-5, 1e9).unwrap();
        let ctx = layout_context(&mesh, &[16, 4], 4);
        let specs: Vec<_> = ["RR", "S0R", "RS0"]
            .iter()
            .map(|s| ShardingSpec::parse(s).unwrap())
            .collect();
        let m = ctx.cost_matrix(&specs, &specs).unwrap();
        for (i, s) in specs.iter().enumerate() {
            for (j, d) in specs.iter().enumerate() {
                let p = ctx.path(s, d).unwrap();
                assert_eq!(m.forward_s[i * 3 + j], p.forward_cost_s);
                assert_eq!(m.backward_s[i * 3 + j], p.backward_cost_s);
            }
        }
        assert_eq!(m.forward_s[0], 0.0);
    }
}
