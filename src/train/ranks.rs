//! Where a run's ranks are (`Ranks`, in the resolved run), and this process's place in a
//! launcher's job (`EnvRank`, from torchrun's, mpirun's or Slurm's environment).

use anyhow::{bail, Context, Result};

/// Where a run's ranks are.
#[derive(Debug, Clone)]
pub(crate) enum Ranks {
    /// One rank, world 1, on this thread; the CUDA ordinal (ignored on the CPU).
    Solo(usize),
    /// One rank per listed device, a thread each: CUDA ordinals, or virtual CPU ranks.
    Threads { cuda: bool, devices: Vec<usize> },
    /// This process is one rank of a job its launcher started: a GPU (NCCL) or the CPU (TCP).
    Process { cuda: bool, env: EnvRank },
}

/// This process's place in a multi-process run, from the launcher's environment: torchrun's
/// (or mpirun's) RANK, WORLD_SIZE, LOCAL_RANK when RANK or WORLD_SIZE is set, else Slurm's
/// SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (one launcher's set whole, never a mix); rank 0's
/// host from MASTER_ADDR, and our port MASTER_PORT + 1, or LORA_TRAIN_PORT when set.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvRank {
    /// This process's rank, 0..world.
    pub rank: usize,
    /// How many ranks the job has.
    pub world: usize,
    /// The rank among this host's ranks: the CUDA ordinal it uses.
    pub local: usize,
    /// Rank 0's host (MASTER_ADDR).
    pub addr: String,
    /// The port rank 0 listens on: MASTER_PORT + 1 (torchrun's own rendezvous store listens
    /// on MASTER_PORT itself), or LORA_TRAIN_PORT.
    pub port: u16,
}

/// The variables of one launcher: (rank, world size, local rank).
const TORCHRUN: [&str; 3] = ["RANK", "WORLD_SIZE", "LOCAL_RANK"];
const SLURM: [&str; 3] = ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"];

impl EnvRank {
    /// None when no launcher variables are set (or the world is 1).
    pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<EnvRank>> {
        let num = |name: &str, v: String| -> Result<usize> {
            v.trim()
                .parse()
                .with_context(|| format!("environment variable {name} = {v:?} is not a number"))
        };
        let names = match TORCHRUN[..2].iter().any(|k| get(k).is_some()) {
            true => TORCHRUN,
            false => SLURM,
        };
        let [r, w, l] = names;
        let (rank, world) = match (get(r), get(w)) {
            (None, None) => return Ok(None),
            (Some(rank), Some(world)) => (num(r, rank)?, num(w, world)?),
            (Some(_), None) => bail!("environment: {r} is set but {w} is not: set both"),
            (None, Some(_)) => bail!("environment: {w} is set but {r} is not: set both"),
        };
        if world <= 1 {
            return Ok(None);
        }
        if rank >= world {
            bail!("environment: {r} = {rank} but {w} = {world}: a rank is 0..{w}");
        }
        let local = match get(l) {
            Some(v) => num(l, v)?,
            None => 0,
        };
        // Under Slurm, how an sbatch script sets what srun does not.
        let slurm = match w {
            "SLURM_NTASKS" => " (in an sbatch script: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) MASTER_PORT=29500; docs/multi-node.md)",
            _ => "",
        };
        let addr = get("MASTER_ADDR").with_context(|| {
            format!("{w} = {world} ({r} = {rank}) but MASTER_ADDR is not set: export MASTER_ADDR=<rank 0's host>{slurm}")
        })?;
        let port = match get("LORA_TRAIN_PORT") {
            Some(p) => num("LORA_TRAIN_PORT", p)?,
            None => {
                let p = get("MASTER_PORT").with_context(|| {
                    format!("{w} = {world} ({r} = {rank}) but MASTER_PORT is not set: export MASTER_PORT=<a free port>{slurm}")
                })?;
                num("MASTER_PORT", p)? + 1
            }
        };
        let port = u16::try_from(port)
            .ok()
            .filter(|&p| p > 0)
            .with_context(|| {
                format!(
                    "port {port} (MASTER_PORT + 1, or LORA_TRAIN_PORT) is out of range 1..65535"
                )
            })?;
        Ok(Some(EnvRank {
            rank,
            world,
            local,
            addr,
            port,
        }))
    }
}
