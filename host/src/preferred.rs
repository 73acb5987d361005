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
        return Err(Invalid(format!("must-include device {m:?} is not among the available devices")));
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
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct Rank(usize, std::cmp::Reverse<u64>, Vec<usize>);

struct Ctx<'a> {
    cands: Vec<Candidate<'a>>,
    score: HashMap<(usize, usize), u64>,
}

impl Ctx<'_> {
    fn pair(&self, a: usize, b: usize) -> u64 {
        self.score.get(&(a.min(b), a.max(b))).copied().unwrap_or(0)
    }

    fn rank(&self, set: &[usize]) -> Rank {
        let numas: HashSet<Option<i64>> = set.iter().map(|&i| self.cands[i].numa).collect();
        let mut links = 0;
        for (x, &a) in set.iter().enumerate() {
            for &b in &set[x + 1..] {
                links += self.pair(a, b);
            }
        }
        let mut order: Vec<usize> = set.iter().map(|&i| self.cands[i].order).collect();
        order.sort_unstable();
        Rank(numas.len(), std::cmp::Reverse(links), order)
    }
}

/// Above this many combinations the search turns greedy.
const EXHAUSTIVE_LIMIT: u128 = 20_000;

fn binomial(n: usize, k: usize) -> u128 {
    let k = k.min(n - k.min(n));
    (0..k).fold(1u128, |acc, i| acc.saturating_mul((n - i) as u128) / (i as u128 + 1))
}

/// Picks `size` devices. `links(a, b)` gives the driver's score between two
/// IDs (0 when unknown). The request must already be validated.
pub fn choose(
    cands: Vec<Candidate<'_>>,
    must: &[String],
    size: usize,
    links: impl Fn(&str, &str) -> u32,
) -> Vec<String> {
    let index: HashMap<&str, usize> = cands.iter().enumerate().map(|(i, c)| (c.id, i)).collect();
    let mut score = HashMap::new();
    for a in 0..cands.len() {
        for b in a + 1..cands.len() {
            let s = u64::from(links(cands[a].id, cands[b].id)) + u64::from(links(cands[b].id, cands[a].id));
            if s > 0 {
                score.insert((a, b), s);
            }
        }
    }
    let ctx = Ctx { cands, score };
    let fixed: Vec<usize> = must.iter().filter_map(|m| index.get(m.as_str()).copied()).collect();
    let fixed_set: HashSet<usize> = fixed.iter().copied().collect();
    let mut free: Vec<usize> = (0..ctx.cands.len()).filter(|i| !fixed_set.contains(i)).collect();
    free.sort_by_key(|&i| ctx.cands[i].order);
    let need = size - fixed.len();
    let best = if binomial(free.len(), need) <= EXHAUSTIVE_LIMIT {
        exhaustive(&ctx, &fixed, &free, need)
    } else {
        greedy(&ctx, &fixed, &free, need)
    };
    let mut out: Vec<usize> = best;
    out.sort_by_key(|&i| ctx.cands[i].order);
    out.into_iter().map(|i| ctx.cands[i].id.to_string()).collect()
}

fn exhaustive(ctx: &Ctx<'_>, fixed: &[usize], free: &[usize], need: usize) -> Vec<usize> {
    let mut best: Option<(Rank, Vec<usize>)> = None;
    let mut pick: Vec<usize> = Vec::with_capacity(need);
    fn walk(
        ctx: &Ctx<'_>,
        fixed: &[usize],
        free: &[usize],
        need: usize,
        start: usize,
        pick: &mut Vec<usize>,
        best: &mut Option<(Rank, Vec<usize>)>,
    ) {
        if pick.len() == need {
            let set: Vec<usize> = fixed.iter().chain(pick.iter()).copied().collect();
            let r = ctx.rank(&set);
            if best.as_ref().is_none_or(|(b, _)| r < *b) {
                *best = Some((r, set));
            }
            return;
        }
        for i in start..free.len() {
            if free.len() - i < need - pick.len() {
                break;
            }
            pick.push(free[i]);
            walk(ctx, fixed, free, need, i + 1, pick, best);
            pick.pop();
        }
    }
    walk(ctx, fixed, free, need, 0, &mut pick, &mut best);
    best.map(|(_, s)| s).unwrap_or_else(|| fixed.to_vec())
}

/// Greedy: for each NUMA pool able to hold the request (and the whole set),
/// and each seed, grow by the device best linked to the set so far.
fn greedy(ctx: &Ctx<'_>, fixed: &[usize], free: &[usize], need: usize) -> Vec<usize> {
    let mut pools: Vec<Vec<usize>> = Vec::new();
    let mut by_numa: HashMap<Option<i64>, Vec<usize>> = HashMap::new();
    for &i in free {
        by_numa.entry(ctx.cands[i].numa).or_default().push(i);
    }
    for pool in by_numa.into_values() {
        if pool.len() >= need {
            pools.push(pool);
        }
    }
    pools.push(free.to_vec());
    let mut best: Option<(Rank, Vec<usize>)> = None;
    for pool in &pools {
        // Seeds: the fixed set alone, or each of the first few devices.
        let seeds: Vec<Option<usize>> =
            if !fixed.is_empty() || need == 0 { vec![None] } else { pool.iter().take(64).map(|&i| Some(i)).collect() };
        for seed in seeds {
            let mut set: Vec<usize> = fixed.to_vec();
            let mut left: Vec<usize> = pool.clone();
            if let Some(s) = seed {
                set.push(s);
                left.retain(|&i| i != s);
            }
            while set.len() < fixed.len() + need {
                let Some((pos, _)) = left
                    .iter()
                    .enumerate()
                    .map(|(pos, &c)| (pos, set.iter().map(|&m| ctx.pair(m, c)).sum::<u64>()))
                    .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)))
                else {
                    break;
                };
                set.push(left.remove(pos));
            }
            let r = ctx.rank(&set);
            if best.as_ref().is_none_or(|(b, _)| r < *b) {
                best = Some((r, set));
            }
        }
    }
    best.map(|(_, s)| s).unwrap_or_else(|| fixed.to_vec())
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
        choose(c, &must, size, |a, b| {
            links.iter().find(|(x, y, _)| format!("d{x}") == a && format!("d{y}") == b).map(|l| l.2).unwrap_or(0)
        })
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
        let mut score = HashMap::new();
        for (a, b, s) in links {
            score.insert((a, b), u64::from(s));
        }
        let ctx = Ctx { cands: c, score };
        let free: Vec<usize> = (0..8).collect();
        let e = exhaustive(&ctx, &[], &free, 4);
        let g = greedy(&ctx, &[], &free, 4);
        assert_eq!(ctx.rank(&e).0, ctx.rank(&g).0);
        assert_eq!(ctx.rank(&e).1, ctx.rank(&g).1);
        assert_eq!(ctx.rank(&e).1, std::cmp::Reverse(8), "two linked pairs");
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
