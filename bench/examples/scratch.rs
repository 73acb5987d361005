//! Prototype of a faster preferred::choose with the same answers.
use devhost::preferred::{Candidate, choose};
use devhost_bench::prefer::{Instance, Rng, random_instance};
use devhost_bench::stats::{Samples, fmt_dur};
use std::collections::HashMap;
use std::time::Instant;

struct Ctx {
    numa: Vec<Option<i64>>,
    order: Vec<usize>,
    adj: Vec<Vec<(usize, u64)>>, // symmetric sums a<->b
    pair: HashMap<(usize, usize), u64>,
    dense: Vec<u64>,
}
impl Ctx {
    fn pair(&self, a: usize, b: usize) -> u64 {
        if !self.dense.is_empty() {
            return self.dense[a * self.numa.len() + b];
        }
        self.pair.get(&(a.min(b), a.max(b))).copied().unwrap_or(0)
    }
    fn rank(&self, set: &[usize]) -> (usize, std::cmp::Reverse<u64>, Vec<usize>) {
        let mut numas: Vec<Option<i64>> = set.iter().map(|&i| self.numa[i]).collect();
        numas.sort_unstable();
        numas.dedup();
        let mut links = 0;
        for (x, &a) in set.iter().enumerate() {
            for &b in &set[x + 1..] {
                links += self.pair(a, b);
            }
        }
        let mut order: Vec<usize> = set.iter().map(|&i| self.order[i]).collect();
        order.sort_unstable();
        (numas.len(), std::cmp::Reverse(links), order)
    }
}

/// links: per candidate, (other candidate index, directed score)
fn choose_fast(
    ids: &[&str],
    numa: &[Option<i64>],
    links: &[Vec<(usize, u32)>],
    must: &[usize],
    size: usize,
) -> Vec<String> {
    let n = ids.len();
    let mut pair: HashMap<(usize, usize), u64> = HashMap::new();
    for (a, l) in links.iter().enumerate() {
        for &(b, s) in l {
            if a != b && s > 0 {
                *pair.entry((a.min(b), a.max(b))).or_default() += u64::from(s);
            }
        }
    }
    let mut adj = vec![Vec::new(); n];
    for (&(a, b), &s) in &pair {
        adj[a].push((b, s));
        adj[b].push((a, s));
    }
    let mut dense = Vec::new();
    if n <= 512 {
        dense = vec![0u64; n * n];
        for (&(a, b), &s) in &pair {
            dense[a * n + b] = s;
            dense[b * n + a] = s;
        }
    }
    let ctx = Ctx { numa: numa.to_vec(), order: (0..n).collect(), adj, pair, dense };
    let fixed: Vec<usize> = must.to_vec();
    let free: Vec<usize> = (0..n).filter(|i| !fixed.contains(i)).collect();
    let need = size - fixed.len();
    let combos = (0..need).fold(1u128, |acc, i| acc.saturating_mul((free.len() - i) as u128) / (i as u128 + 1));
    let mut best =
        if combos <= 20_000 { exhaustive(&ctx, &fixed, &free, need) } else { greedy(&ctx, &fixed, &free, need) };
    best.sort_unstable();
    best.into_iter().map(|i| ids[i].to_string()).collect()
}

fn exhaustive(ctx: &Ctx, fixed: &[usize], free: &[usize], need: usize) -> Vec<usize> {
    // incremental: numa counts and link sum
    let mut numa_count: HashMap<Option<i64>, usize> = HashMap::new();
    let mut links = 0u64;
    let mut set: Vec<usize> = Vec::new();
    for &f in fixed {
        for &m in &set {
            links += ctx.pair(f, m);
        }
        set.push(f);
        *numa_count.entry(ctx.numa[f]).or_default() += 1;
    }
    let mut best: Option<(usize, u64, Vec<usize>)> = None;
    fn walk(
        ctx: &Ctx,
        free: &[usize],
        need: usize,
        start: usize,
        set: &mut Vec<usize>,
        base: usize,
        links: u64,
        nc: &mut HashMap<Option<i64>, usize>,
        best: &mut Option<(usize, u64, Vec<usize>)>,
    ) {
        if set.len() - base == need {
            let numas = nc.values().filter(|&&c| c > 0).count();
            // lexicographic enumeration: first found wins ties
            if best.as_ref().is_none_or(|(bn, bl, _)| (numas, std::cmp::Reverse(links)) < (*bn, std::cmp::Reverse(*bl)))
            {
                *best = Some((numas, links, set.clone()));
            }
            return;
        }
        for i in start..free.len() {
            if free.len() - i < need - (set.len() - base) {
                break;
            }
            let x = free[i];
            let add: u64 = set.iter().map(|&m| ctx.pair(x, m)).sum();
            *nc.entry(ctx.numa[x]).or_default() += 1;
            set.push(x);
            walk(ctx, free, need, i + 1, set, base, links + add, nc, best);
            set.pop();
            *nc.entry(ctx.numa[x]).or_default() -= 1;
        }
    }
    let base = set.len();
    walk(ctx, free, need, 0, &mut set, base, links, &mut numa_count, &mut best);
    best.map(|b| b.2).unwrap_or_else(|| fixed.to_vec())
}

fn greedy(ctx: &Ctx, fixed: &[usize], free: &[usize], need: usize) -> Vec<usize> {
    let n = ctx.numa.len();
    let mut by_numa: HashMap<Option<i64>, Vec<usize>> = HashMap::new();
    for &i in free {
        by_numa.entry(ctx.numa[i]).or_default().push(i);
    }
    let mut pools: Vec<Vec<usize>> = by_numa.into_values().filter(|p| p.len() >= need).collect();
    pools.push(free.to_vec());
    let mut best: Option<(_, Vec<usize>)> = None;
    let mut gain = vec![0u64; n];
    let mut taken = vec![false; n];
    for pool in &pools {
        let seeds: Vec<Option<usize>> =
            if !fixed.is_empty() || need == 0 { vec![None] } else { pool.iter().take(64).map(|&i| Some(i)).collect() };
        for seed in seeds {
            for &c in pool {
                gain[c] = 0;
                taken[c] = false;
            }
            let mut set: Vec<usize> = Vec::with_capacity(fixed.len() + need);
            let add = |x: usize, set: &mut Vec<usize>, gain: &mut [u64], taken: &mut [bool]| {
                set.push(x);
                taken[x] = true;
                for &(c, s) in &ctx.adj[x] {
                    gain[c] += s;
                }
            };
            for &f in fixed {
                add(f, &mut set, &mut gain, &mut taken);
            }
            if let Some(s) = seed {
                add(s, &mut set, &mut gain, &mut taken);
            }
            while set.len() < fixed.len() + need {
                let mut pick: Option<usize> = None;
                for &c in pool {
                    if !taken[c] && pick.is_none_or(|p| gain[c] > gain[p]) {
                        pick = Some(c);
                    }
                }
                let Some(p) = pick else { break };
                add(p, &mut set, &mut gain, &mut taken);
            }
            for &f in fixed {
                let _ = f;
            }
            let r = ctx.rank(&set);
            if best.as_ref().is_none_or(|(b, _)| r < *b) {
                best = Some((r, set));
            }
            // reset gains touched by fixed (fixed not in pool)
            for &c in ctx.adj.iter().flatten().map(|(c, _)| c).collect::<Vec<_>>().iter() {
                let _ = c;
            }
        }
    }
    best.map(|(_, s)| s).unwrap_or_else(|| fixed.to_vec())
}

fn run_both(inst: &Instance) -> (Vec<String>, Vec<String>, std::time::Duration, std::time::Duration) {
    let t = Instant::now();
    let a = inst.choose();
    let ta = t.elapsed();
    let ids: Vec<&str> = inst.ids.iter().map(String::as_str).collect();
    let mut links = vec![Vec::new(); ids.len()];
    for (&(a, b), &s) in &inst.links {
        links[a].push((b, s));
    }
    let t = Instant::now();
    let b = choose_fast(&ids, &inst.numa, &links, &inst.must, inst.size);
    let tb = t.elapsed();
    let _ = (Candidate { id: "x", numa: None, order: 0 }, choose as fn(_, _, _, fn(&str, &str) -> u32) -> _);
    (a, b, ta, tb)
}

fn swap_improve(inst: &Instance, mut set: Vec<usize>) -> Vec<usize> {
    let key = |s: &Vec<usize>| {
        let mut v = s.clone();
        v.sort_unstable();
        let (a, b) = inst.quality(&v);
        (a, std::cmp::Reverse(b), v)
    };
    loop {
        let cur = key(&set);
        let mut improved = None;
        'o: for i in 0..set.len() {
            if inst.must.contains(&set[i]) {
                continue;
            }
            for c in 0..inst.ids.len() {
                if set.contains(&c) {
                    continue;
                }
                let mut t = set.clone();
                t[i] = c;
                if key(&t) < cur {
                    improved = Some(t);
                    break 'o;
                }
            }
        }
        match improved {
            Some(t) => set = t,
            None => {
                set.sort_unstable();
                return set;
            }
        }
    }
}

fn main() {
    let mut rng = Rng::new(0xbead);
    let (mut g, mut gs, mut t) = (0, 0, 0);
    for _ in 0..300 {
        let inst = random_instance(&mut rng, 20_001..=300_000);
        let best = inst.brute_force();
        let got = inst.indices(&inst.choose());
        let sw = swap_improve(&inst, got.clone());
        t += 1;
        if inst.quality(&got) == inst.quality(&best) {
            g += 1;
        }
        if inst.quality(&sw) == inst.quality(&best) {
            gs += 1;
        }
    }
    println!("greedy optimal quality {g}/{t}, greedy+1-swap {gs}/{t}");
    let mut rng = Rng::new(42);
    let (mut same, mut total) = (0, 0);
    for combos in [1..=20_000u128, 20_001..=300_000] {
        for _ in 0..300 {
            let inst = random_instance(&mut rng, combos.clone());
            let (a, b, _, _) = run_both(&inst);
            total += 1;
            if a == b {
                same += 1
            } else if total - same < 5 {
                println!("DIFF n={} size={} must={:?}\n {a:?}\n {b:?}", inst.ids.len(), inst.size, inst.must);
            }
        }
    }
    println!("identical answers: {same}/{total}");
    for (n, k, reps) in [(16, 8, 50), (64, 8, 50), (256, 8, 5), (1024, 8, 2), (10_000, 8, 1)] {
        let inst = Instance::grouped(n, k);
        let (mut sa, mut sb) = (Samples::default(), Samples::default());
        let mut eq = true;
        for _ in 0..reps {
            if n == 10_000 {
                let ids: Vec<&str> = inst.ids.iter().map(String::as_str).collect();
                let mut links = vec![Vec::new(); ids.len()];
                for (&(a, b), &s) in &inst.links {
                    links[a].push((b, s));
                }
                let t = Instant::now();
                let b = choose_fast(&ids, &inst.numa, &links, &inst.must, inst.size);
                sb.push(t.elapsed());
                println!("10000 fast answer {b:?}");
                continue;
            }
            let (a, b, ta, tb) = run_both(&inst);
            eq &= a == b;
            sa.push(ta);
            sb.push(tb);
        }
        let f = |s: &Samples| s.summary().map(|x| fmt_dur(x.p50)).unwrap_or("-".into());
        println!("n={n} k={k}: current {} proposed {} same={eq}", f(&sa), f(&sb));
    }
}
