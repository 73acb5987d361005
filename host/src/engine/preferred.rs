//! The host's default GetPreferredAllocation, for every vendor: always a
//! valid answer (a subset of `available` holding every must-include ID,
//! exactly `size` long, no duplicates), preferring one NUMA node, then the
//! best-connected set by the drivers' link scores, then a stable order.
//! Small instances are searched exhaustively; large ones greedily.

use std::collections::{HashMap, HashSet};

/// What the policy knows about one candidate device.
#[derive(Clone, Debug)]
pub struct Candidate<'a> {
    pub id: &'a str,
    pub numa: Option<i64>,
    /// Position in the resource's device list (the stable order).
    pub order: usize,
}

/// A bad request, described for the gRPC error.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// Checks the request the way the kubelet's contract requires.
pub fn validate(available: &[String], must: &[String], size: i32) -> Result<usize, Invalid> {
    let size = usize::try_from(size).map_err(|_| Invalid(format!("allocation_size {size} is negative")))?;
    let set: HashSet<&str> = available.iter().map(String::as_str).collect();
    if set.len() != available.len() {
        return Err(Invalid("available_deviceIDs contains duplicates".into()));
    }
    if let Some(m) = must.iter().find(|m| !set.contains(m.as_str())) {
        let m = crate::driver::device::quoted(m);
        return Err(Invalid(format!("must-include device {m} is not among the available devices")));
    }
    let must_set: HashSet<&str> = must.iter().map(String::as_str).collect();
    if must_set.len() != must.len() {
        return Err(Invalid("must_include_deviceIDs contains duplicates".into()));
    }
    if size > available.len() {
        return Err(Invalid(format!(
            "allocation_size {size} is larger than the {} available devices",
            available.len()
        )));
    }
    if must.len() > size {
        return Err(Invalid(format!("{} must-include devices exceed allocation_size {size}", must.len())));
    }
    Ok(size)
}

/// Ranking of a candidate set: fewer NUMA nodes, then higher link score,
/// then the earliest devices in stable order.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Rank(usize, std::cmp::Reverse<u64>, Vec<usize>);

/// The candidates with their links as adjacency lists (scores of both
/// directions summed), built once per request.
struct Graph<'a> {
    cands: Vec<Candidate<'a>>,
    adj: Vec<Vec<(usize, u64)>>,
    /// NUMA node of each candidate as a small index (None is its own node).
    numa: Vec<usize>,
    numa_count: usize,
}

impl<'a> Graph<'a> {
    fn new(cands: Vec<Candidate<'a>>, edges: &[(usize, usize, u32)]) -> Graph<'a> {
        let n = cands.len();
        let mut sums: HashMap<(usize, usize), u64> = HashMap::new();
        for &(a, b, s) in edges {
            if a != b && a < n && b < n && s > 0 {
                *sums.entry((a.min(b), a.max(b))).or_default() += u64::from(s);
            }
        }
        let mut adj = vec![Vec::new(); n];
        for ((a, b), s) in sums {
            adj[a].push((b, s));
            adj[b].push((a, s));
        }
        let mut nodes: Vec<Option<i64>> = Vec::new();
        let numa = cands
            .iter()
            .map(|c| match nodes.iter().position(|&x| x == c.numa) {
                Some(i) => i,
                None => {
                    nodes.push(c.numa);
                    nodes.len() - 1
                }
            })
            .collect();
        Graph { cands, adj, numa, numa_count: nodes.len() }
    }

    fn rank(&self, set: &[usize]) -> Rank {
        let mut member = vec![false; self.cands.len()];
        for &i in set {
            member[i] = true;
        }
        let mut seen = vec![false; self.numa_count];
        let mut nodes = 0;
        let mut links = 0;
        for &a in set {
            if !std::mem::replace(&mut seen[self.numa[a]], true) {
                nodes += 1;
            }
            links += self.adj[a].iter().filter(|(b, _)| member[*b] && *b > a).map(|(_, s)| s).sum::<u64>();
        }
        let mut order: Vec<usize> = set.iter().map(|&i| self.cands[i].order).collect();
        order.sort_unstable();
        Rank(nodes, std::cmp::Reverse(links), order)
    }
}

/// Above this many combinations the search turns greedy.
const EXHAUSTIVE_LIMIT: u128 = 20_000;

/// Up to this many candidates, the greedy answer is polished by swaps.
const SWAP_LIMIT: usize = 1024;

fn binomial(n: usize, k: usize) -> u128 {
    let k = k.min(n - k.min(n));
    (0..k).fold(1u128, |acc, i| acc.saturating_mul((n - i) as u128) / (i as u128 + 1))
}

/// Picks `size` devices. `edges` are the drivers' link scores between
/// candidates, by index into `cands` (each direction as reported; they are
/// summed). The request must already be validated.
pub fn choose(cands: Vec<Candidate<'_>>, must: &[String], size: usize, edges: &[(usize, usize, u32)]) -> Vec<String> {
    let index: HashMap<&str, usize> = cands.iter().enumerate().map(|(i, c)| (c.id, i)).collect();
    let g = Graph::new(cands, edges);
    let fixed: Vec<usize> = must.iter().filter_map(|m| index.get(m.as_str()).copied()).collect();
    let fixed_set: HashSet<usize> = fixed.iter().copied().collect();
    let mut free: Vec<usize> = (0..g.cands.len()).filter(|i| !fixed_set.contains(i)).collect();
    free.sort_by_key(|&i| g.cands[i].order);
    let need = size.saturating_sub(fixed.len()).min(free.len());
    let best = if binomial(free.len(), need) <= EXHAUSTIVE_LIMIT {
        exhaustive(&g, &fixed, &free, need)
    } else {
        greedy(&g, &fixed, &free, need)
    };
    let mut out: Vec<usize> = best;
    out.sort_by_key(|&i| g.cands[i].order);
    out.into_iter().map(|i| g.cands[i].id.to_string()).collect()
}

/// Every combination, in stable order, with NUMA nodes and link totals kept
/// running; the first combination of the best (nodes, links) is also the
/// earliest in stable order, as [`Rank`] wants.
/// (NUMA nodes, links) of a set, compared before stable order.
type Key = (usize, std::cmp::Reverse<u64>);

fn exhaustive(g: &Graph<'_>, fixed: &[usize], free: &[usize], need: usize) -> Vec<usize> {
    struct Walk<'g, 'a> {
        g: &'g Graph<'a>,
        free: &'g [usize],
        need: usize,
        member: Vec<bool>,
        per_node: Vec<usize>,
        nodes: usize,
        links: u64,
        pick: Vec<usize>,
        best: Option<(Key, Vec<usize>)>,
    }
    impl Walk<'_, '_> {
        fn add(&mut self, i: usize) {
            self.links += self.g.adj[i].iter().filter(|(b, _)| self.member[*b]).map(|(_, s)| s).sum::<u64>();
            self.member[i] = true;
            let n = self.g.numa[i];
            self.per_node[n] += 1;
            if self.per_node[n] == 1 {
                self.nodes += 1;
            }
        }
        fn remove(&mut self, i: usize) {
            self.member[i] = false;
            self.links -= self.g.adj[i].iter().filter(|(b, _)| self.member[*b]).map(|(_, s)| s).sum::<u64>();
            let n = self.g.numa[i];
            self.per_node[n] -= 1;
            if self.per_node[n] == 0 {
                self.nodes -= 1;
            }
        }
        fn walk(&mut self, start: usize) {
            if self.pick.len() == self.need {
                let key = (self.nodes, std::cmp::Reverse(self.links));
                if self.best.as_ref().is_none_or(|(b, _)| key < *b) {
                    self.best = Some((key, self.pick.clone()));
                }
                return;
            }
            for k in start..self.free.len() {
                if self.free.len() - k < self.need - self.pick.len() {
                    break;
                }
                let i = self.free[k];
                self.add(i);
                self.pick.push(i);
                self.walk(k + 1);
                self.pick.pop();
                self.remove(i);
            }
        }
    }
    let mut w = Walk {
        g,
        free,
        need,
        member: vec![false; g.cands.len()],
        per_node: vec![0; g.numa_count],
        nodes: 0,
        links: 0,
        pick: Vec::with_capacity(need),
        best: None,
    };
    for &f in fixed {
        w.add(f);
    }
    w.walk(0);
    let pick = w.best.map(|(_, p)| p).unwrap_or_default();
    fixed.iter().chain(pick.iter()).copied().collect()
}

/// Greedy: for each NUMA pool able to hold the request (and the whole set),
/// and each seed, grow by the device best linked to the set so far (running
/// gains, updated as members join); then improve the best set by swaps.
fn greedy(g: &Graph<'_>, fixed: &[usize], free: &[usize], need: usize) -> Vec<usize> {
    let mut by_numa: Vec<Vec<usize>> = vec![Vec::new(); g.numa_count];
    for &i in free {
        by_numa[g.numa[i]].push(i);
    }
    let mut pools: Vec<Vec<usize>> = by_numa.into_iter().filter(|p| p.len() >= need).collect();
    pools.push(free.to_vec());
    let n = g.cands.len();
    let mut gain = vec![0u64; n];
    let mut member = vec![false; n];
    let mut best: Option<(Rank, Vec<usize>)> = None;
    for pool in &pools {
        let seeds: Vec<Option<usize>> =
            if !fixed.is_empty() || need == 0 { vec![None] } else { pool.iter().take(64).map(|&i| Some(i)).collect() };
        for seed in seeds {
            gain.iter_mut().for_each(|x| *x = 0);
            member.iter_mut().for_each(|x| *x = false);
            let mut set: Vec<usize> = Vec::with_capacity(fixed.len() + need);
            let join = |i: usize, set: &mut Vec<usize>, member: &mut [bool], gain: &mut [u64]| {
                set.push(i);
                member[i] = true;
                for &(b, s) in &g.adj[i] {
                    gain[b] += s;
                }
            };
            for &f in fixed {
                join(f, &mut set, &mut member, &mut gain);
            }
            if let Some(s) = seed {
                join(s, &mut set, &mut member, &mut gain);
            }
            while set.len() < fixed.len() + need {
                // Highest gain; the first in pool (stable) order on ties.
                let next = pool.iter().copied().filter(|&c| !member[c]).fold(None, |acc: Option<usize>, c| match acc {
                    Some(a) if gain[a] >= gain[c] => Some(a),
                    _ => Some(c),
                });
                let Some(c) = next else { break };
                join(c, &mut set, &mut member, &mut gain);
            }
            let r = g.rank(&set);
            if best.as_ref().is_none_or(|(b, _)| r < *b) {
                best = Some((r, set));
            }
        }
    }
    let Some((mut rank, mut set)) = best else { return fixed.to_vec() };
    // Swap one member for one outsider while that improves the rank.
    if free.len() <= SWAP_LIMIT {
        let fixed_set: HashSet<usize> = fixed.iter().copied().collect();
        for _ in 0..4 {
            let mut improved = false;
            for pos in 0..set.len() {
                if fixed_set.contains(&set[pos]) {
                    continue;
                }
                for &c in free {
                    if set.contains(&c) {
                        continue;
                    }
                    let old = std::mem::replace(&mut set[pos], c);
                    let r = g.rank(&set);
                    if r < rank {
                        rank = r;
                        improved = true;
                    } else {
                        set[pos] = old;
                    }
                }
            }
            if !improved {
                break;
            }
        }
    }
    set
}

/// Repairs a driver's proposal: keeps its valid, available, distinct IDs in
/// order after the must-includes, fills up from `fallback`, trims to size.
pub fn repair(
    proposal: &[String],
    available: &[String],
    must: &[String],
    size: usize,
    fallback: &[String],
) -> Vec<String> {
    let avail: HashSet<&str> = available.iter().map(String::as_str).collect();
    let mut out: Vec<String> = must.to_vec();
    for id in proposal.iter().chain(fallback.iter()) {
        if out.len() >= size {
            break;
        }
        if avail.contains(id.as_str()) && !out.contains(id) {
            out.push(id.clone());
        }
    }
    out.truncate(size.max(must.len()));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cands(numa: &[i64]) -> Vec<(String, Option<i64>)> {
        numa.iter().enumerate().map(|(i, n)| (format!("d{i}"), Some(*n))).collect()
    }

    fn run(devs: &[(String, Option<i64>)], must: &[&str], size: usize, links: &[(usize, usize, u32)]) -> Vec<String> {
        let c = devs.iter().enumerate().map(|(i, (id, n))| Candidate { id, numa: *n, order: i }).collect();
        let must: Vec<String> = must.iter().map(|s| s.to_string()).collect();
        choose(c, &must, size, links)
    }

    #[test]
    fn prefers_a_single_numa_node() {
        let d = cands(&[0, 1, 0, 1, 1]);
        assert_eq!(run(&d, &[], 3, &[]), vec!["d1", "d3", "d4"]);
    }

    #[test]
    fn prefers_linked_devices_within_a_node() {
        let d = cands(&[0, 0, 0, 0]);
        assert_eq!(run(&d, &[], 2, &[(1, 3, 10)]), vec!["d1", "d3"]);
    }

    #[test]
    fn must_include_is_kept() {
        // NUMA locality wins over a link to another node...
        let d = cands(&[0, 0, 1, 1]);
        assert_eq!(run(&d, &["d0"], 2, &[(0, 3, 5)]), vec!["d0", "d1"]);
        // ...and within the node the linked device is chosen.
        let d = cands(&[0, 0, 0, 1]);
        assert_eq!(run(&d, &["d0"], 2, &[(0, 2, 5)]), vec!["d0", "d2"]);
        assert_eq!(run(&d, &["d3"], 2, &[(0, 2, 5)]), vec!["d0", "d3"]);
    }

    #[test]
    fn greedy_agrees_with_exhaustive_on_pairs() {
        // 8 devices, NVLink pairs (0,1) (2,3) (4,5) (6,7).
        let d = cands(&[0; 8]);
        let links: [(usize, usize, u32); 4] = [(0, 1, 4), (2, 3, 4), (4, 5, 4), (6, 7, 4)];
        let c: Vec<Candidate<'_>> =
            d.iter().enumerate().map(|(i, (id, n))| Candidate { id, numa: *n, order: i }).collect();
        let g = Graph::new(c, &links);
        let free: Vec<usize> = (0..8).collect();
        let e = exhaustive(&g, &[], &free, 4);
        let gr = greedy(&g, &[], &free, 4);
        assert_eq!(g.rank(&e).0, g.rank(&gr).0);
        assert_eq!(g.rank(&e).1, g.rank(&gr).1);
        assert_eq!(g.rank(&e).1, std::cmp::Reverse(8), "two linked pairs");
        assert_eq!(e, [0, 1, 2, 3], "the earliest of the equally good sets");
    }

    /// A small deterministic generator for property checks.
    fn lcg(state: &mut u64) -> u64 {
        *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *state >> 33
    }

    #[test]
    fn greedy_with_swaps_matches_exhaustive_search_on_random_instances() {
        let mut seed = 7u64;
        let (mut same, total) = (0, 200);
        for _ in 0..total {
            let n = 10 + (lcg(&mut seed) % 6) as usize;
            let size = 2 + (lcg(&mut seed) % 4) as usize;
            let numa: Vec<i64> = (0..n).map(|_| (lcg(&mut seed) % 2) as i64).collect();
            let d = cands(&numa);
            let mut edges = Vec::new();
            for a in 0..n {
                for b in a + 1..n {
                    if lcg(&mut seed).is_multiple_of(3) {
                        edges.push((a, b, (lcg(&mut seed) % 10) as u32 + 1));
                    }
                }
            }
            let mk =
                || d.iter().enumerate().map(|(i, (id, n))| Candidate { id, numa: *n, order: i }).collect::<Vec<_>>();
            let g = Graph::new(mk(), &edges);
            let free: Vec<usize> = (0..n).collect();
            let e = exhaustive(&g, &[], &free, size);
            let gr = greedy(&g, &[], &free, size);
            assert_eq!(gr.len(), size);
            let (re, rg) = (g.rank(&e), g.rank(&gr));
            assert!(re <= rg, "exhaustive is never beaten");
            if (re.0, re.1) == (rg.0, rg.1) {
                same += 1;
            }
        }
        // Greedy is a heuristic; with the swap pass it finds an optimum almost always.
        assert!(same * 100 >= total * 90, "greedy matched the optimum on {same} of {total}");
    }

    #[test]
    fn validation_errors_are_precise() {
        let a: Vec<String> = vec!["x".into(), "y".into()];
        assert!(validate(&a, &[], -1).unwrap_err().0.contains("negative"));
        assert!(validate(&a, &[], 3).unwrap_err().0.contains("larger than the 2"));
        assert!(validate(&a, &["z".into()], 1).unwrap_err().0.contains("\"z\""));
        assert_eq!(validate(&a, &["x".into()], 2), Ok(2));
    }

    #[test]
    fn repair_fixes_a_bad_proposal() {
        let avail: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        let prop: Vec<String> = ["zz", "c", "c", "a"].iter().map(|s| s.to_string()).collect();
        let fb: Vec<String> = ["b", "d"].iter().map(|s| s.to_string()).collect();
        assert_eq!(repair(&prop, &avail, &["d".into()], 3, &fb), vec!["d", "c", "a"]);
        assert_eq!(repair(&[], &avail, &[], 2, &fb), vec!["b", "d"]);
    }
}
