//! The fault corpus of issue 63's acceptance, enumerated: 80 cases in its areas (signals during
//! save and export, SIGKILL then resume, two runs on one directory, resume while running, a
//! loopback Hub that lies in 20 ways, HF_TOKEN, resource limits, adapters for other bases,
//! missing HOME, read-only and non-UTF-8 directories, closed pipes, unknown recipe keys), each
//! with what holds it: a test of this suite (`module::function`), a case of `hub_faults` (by
//! its name), or nothing yet (`Open`, with why). `the_corpus_names_tests_that_exist` keeps the
//! table true to the suite; `scripts/fault_corpus.sh` runs every case's test and reports
//! handled / total, a case counting only when its test passes. The cases no other module
//! held have their tests here (unknown recipe sections and `--set` keys, a Hub cache without a
//! home or that cannot be written, generate into a closed pipe, a write failing inside a
//! checkpoint, a run killed inside its merge).

use crate::common::root;
use std::process::Command;

/// What holds a case.
enum By {
    /// A test of tests/it: "module::function".
    Test(&'static str),
    /// A case of `hub_faults::a_lying_hub_is_caught_in_every_way_and_nothing_false_is_cached`.
    Lie(&'static str),
    /// Not handled, or not shown to be: why.
    Open(&'static str),
}
use By::{Lie, Open, Test};

/// The corpus: (area, case, what holds it), one line a case (scripts/fault_corpus.sh reads it).
#[rustfmt::skip]
const CASES: [(&str, &str, By); 80] = [
    // signals during save and export
    ("signals", "SIGINT mid-run: the step ends, a checkpoint, exit 130", Test("resume::sigint_finishes_the_step_saves_a_checkpoint_and_resume_ends_bit_identical")),
    ("signals", "a second signal while saving: exit at once, the last checkpoint intact", Test("resume::a_second_signal_exits_at_once_and_leaves_the_last_checkpoint_intact")),
    ("signals", "stopped twice and resumed: bit-identical to a run never stopped", Test("resume::a_run_stopped_twice_and_resumed_is_bit_identical_to_one_that_never_stopped")),
    ("signals", "SIGINT / SIGTERM mid-export: the temporary removed, exit 130", Test("export_signals::a_signal_mid_export_removes_its_temporary_and_exits_130")),
    ("signals", "SIGKILL mid-export: the next export removes what it left, nothing else", Test("export_signals::the_next_export_removes_what_a_killed_one_left_and_nothing_else")),
    ("signals", "a signal while the model loads ends the run", Test("bad_input::more_ranks_than_rows_fails_at_once_and_a_signal_during_loading_ends_the_run")),
    ("signals", "a run killed inside its output.merge: the adapter kept, the temporary removed by the next export", Test("fault_corpus::a_run_killed_inside_its_merge_leaves_a_temporary_the_next_export_removes")),
    // SIGKILL then resume
    ("kill", "a kill inside a real checkpoint write: the previous checkpoint byte-identical and loadable, resume goes on", Test("resume::a_kill_in_the_middle_of_a_checkpoint_write_leaves_the_previous_checkpoint_loadable")),
    ("kill", "a damaged or half-written checkpoint: an error naming its file, nothing deleted", Test("bad_input::a_damaged_checkpoint_is_an_error_naming_its_file_and_nothing_is_ever_deleted")),
    ("kill", "a checkpoint state that does not fit the run: the field named, nothing changed", Test("bad_input::a_checkpoint_state_that_does_not_fit_the_run_names_the_field_and_changes_nothing")),
    ("kill", "a killed download resumes where it stopped", Test("hub::a_killed_download_resumes_where_it_stopped")),
    ("kill", "a killed data preparation leaves nothing a later run trusts", Test("data_prepare::a_killed_preparation_leaves_nothing_that_a_later_run_trusts")),
    ("kill", "a damaged or partial data cache is rebuilt", Test("data_cache::a_damaged_or_partial_cache_file_is_rebuilt")),
    // two runs on one directory
    ("two runs", "a second train on a running output.dir refuses, naming the holder's pid", Test("locks::a_second_run_or_a_resume_on_a_locked_output_dir_refuses_and_names_the_holder")),
    ("two runs", "a second export to a locked --out refuses, naming the holder", Test("locks::a_second_export_to_a_locked_out_refuses_and_names_the_holder")),
    ("two runs", "a lock left by a dead process is taken over", Test("locks::a_lock_left_by_a_dead_process_is_taken_over")),
    ("two runs", "two downloads of one repository: the second waits", Test("locks::a_download_waits_for_another_fetching_the_same_repository")),
    ("two runs", "two processes preparing the same data build it once", Test("data_prepare::two_processes_preparing_the_same_data_build_it_once")),
    ("two runs", "a fresh run over a finished one leaves none of its adapter", Test("first_hour::a_fresh_run_leaves_no_adapter_of_the_earlier_run")),
    // resume while running
    ("resume", "train.resume = true on a live run's directory refuses, its checkpoint untouched", Test("locks::a_second_run_or_a_resume_on_a_locked_output_dir_refuses_and_names_the_holder")),
    ("resume", "a resume with another recipe or data, a fresh start over an unfinished run: refused", Test("resume::resume_refuses_a_different_recipe_or_data_and_a_fresh_start_over_an_unfinished_run")),
    // a loopback Hub that lies in 20 ways
    ("hub", "a small file redirected with Content-Length 0", Lie("a small file redirected with Content-Length 0 (once cached as an empty config.json)")),
    ("hub", "an undeclared empty body", Lie("an empty body that nobody declared")),
    ("hub", "X-Linked-Size and the CDN disagree", Lie("X-Linked-Size and the CDN's Content-Length differ")),
    ("hub", "a body cut short every time", Lie("a body cut short every time")),
    ("hub", "bytes altered on the way", Lie("bytes altered on the way (sha256)")),
    ("hub", "a redirect loop", Lie("a redirect loop on the CDN")),
    ("hub", "a redirect to file://", Lie("a redirect to a file:// URL")),
    ("hub", "a redirect without a Location", Lie("a redirect without a Location")),
    ("hub", "an index that is not JSON", Lie("an index that is not JSON")),
    ("hub", "shard names that leave the snapshot", Lie("shard names that leave the snapshot")),
    ("hub", "a size that is not a number", Lie("a size that is not a number")),
    ("hub", "a drip slower than the time-out", Lie("a drip slower than the time-out")),
    ("hub", "a HEAD never answered", Lie("a HEAD that is never answered")),
    ("hub", "503 for good", Lie("503 for good")),
    ("hub", "another commit than asked for", Lie("another commit than the one asked for")),
    ("hub", "an ETag that is a path", Lie("an ETag that is a path")),
    ("hub", "a captive portal's page", Lie("a captive portal's page")),
    ("hub", "more bytes than declared", Lie("more bytes than declared, without a Content-Length")),
    ("hub", "a resume answered from the wrong byte", Lie("a resume answered from the wrong byte")),
    ("hub", "a file list naming a path outside the repository", Lie("a file list naming a path outside the repository")),
    // HF_TOKEN
    ("token", "a small file redirected to another host: the token not sent", Lie("a small file redirected to another host with a token")),
    ("token", "an LFS redirect to another origin: the token not sent", Lie("an LFS redirect to another port (another origin)")),
    ("token", "a file list redirected to another host: the token not sent", Lie("a file list redirected to another host with a token")),
    ("token", "401 / 403: the error names HF_TOKEN, never prints it", Lie("403 to a run with the wrong token")),
    // resource limits
    ("limits", "a CPU run over ulimit -v: exit 3 with the plan, the limit named", Test("host_memory::a_cpu_run_over_ulimit_v_refuses_with_exit_3_naming_the_limit_and_the_plan")),
    ("limits", "a CPU run over the host's memory: exit 3; one within it trains", Test("host_memory::a_cpu_run_over_the_hosts_memory_refuses_and_one_within_it_trains")),
    ("limits", "plan's longest context within the host's pinned memory", Test("host_memory::the_longest_context_advised_fits_the_hosts_pinned_memory")),
    ("limits", "plan takes the host from --host-mem or the environment", Test("host_memory::plan_takes_the_host_from_host_mem_or_the_environment")),
    ("limits", "a file-size limit inside a checkpoint write (SIGXFSZ)", Test("resume::a_kill_in_the_middle_of_a_checkpoint_write_leaves_the_previous_checkpoint_loadable")),
    ("limits", "one huge row costs memory for seq_len tokens, not for the row", Test("data_prepare::one_huge_row_costs_memory_for_seq_len_tokens_not_for_the_row")),
    ("limits", "a huge row is cut before tokenizing", Test("data_cache::a_huge_row_is_cut_before_tokenizing_with_the_same_tokens")),
    ("limits", "huge or impossible counts exit 2 before anything is allocated", Test("bad_input::huge_or_impossible_counts_exit_2_naming_the_key_before_anything_is_allocated")),
    ("limits", "a full disk under a command's output: one error, exit 1", Test("output_streams::a_full_disk_under_a_commands_output_is_one_error_and_exit_1")),
    ("limits", "a full disk under a run's logs: reported once, the run ends as it would", Test("output_streams::a_full_disk_under_a_runs_logs_is_reported_once_and_the_run_ends_as_it_would")),
    ("limits", "a download larger than the disk: refused up front", Lie("a declared size larger than the disk")),
    ("limits", "a cgroup memory limit below the plan", Open("the cgroup files are read (unit test of their paths), but no test runs under a cgroup limit")),
    ("limits", "a write failing inside a checkpoint (EFBIG as ENOSPC would): stopped, the earlier checkpoint kept", Test("fault_corpus::a_write_that_fails_inside_a_checkpoint_stops_the_run_and_keeps_the_earlier_one")),
    // adapters for other bases
    ("adapter", "generate --adapter with an extra layer", Test("adapter_base::generate_refuses_an_adapter_with_an_extra_layer")),
    ("adapter", "lora.init_adapter with an extra layer", Test("adapter_base::init_adapter_refuses_an_adapter_with_an_extra_layer")),
    ("adapter", "a resume from a checkpoint with an extra layer", Test("adapter_base::resume_refuses_a_checkpoint_whose_adapter_has_an_extra_layer")),
    ("adapter", "export (merged and GGUF LoRA) of an adapter with an extra layer", Test("adapter_base::export_refuses_an_adapter_with_an_extra_layer_merged_and_as_gguf_lora")),
    ("adapter", "adapters whose shapes do not fit the base: clear errors, nothing written", Test("merge::adapters_that_do_not_fit_the_base_are_clear_errors_and_write_nothing")),
    ("adapter", "export finds the base an adapter names from any directory", Test("first_hour::export_finds_the_base_from_anywhere")),
    // missing HOME
    ("home", "download without HOME, HF_HOME or XDG_CACHE_HOME: the error names HF_HOME", Test("hub_names::without_a_home_the_error_names_the_variable_to_set")),
    ("home", "a revision that is a path: refused before any request", Test("hub_names::revisions_that_are_paths_are_refused_before_any_request")),
    ("home", "train on a Hub model without a home directory: the error names HF_HOME", Test("fault_corpus::train_on_a_hub_model_without_a_home_names_the_variable_to_set")),
    // read-only and non-UTF-8 directories
    ("dirs", "a run in a non-UTF-8 directory: export and generate find its base", Test("odd_dirs::a_run_in_a_non_utf8_directory_records_its_base_so_export_and_generate_find_it")),
    ("dirs", "a non-UTF-8 base no record can hold: refused before training", Test("odd_dirs::a_non_utf8_base_that_no_record_can_hold_is_refused_before_training")),
    ("dirs", "a run or export into a directory that cannot be written: exit 1 naming it", Test("odd_dirs::a_run_or_an_export_into_a_directory_that_cannot_be_written_exits_1_naming_it")),
    ("dirs", "an unusable cache directory falls back to no cache", Test("data_cache::an_unusable_cache_directory_falls_back_to_no_cache")),
    ("dirs", "a data line that is not UTF-8: a bad row, named", Test("bad_input::a_line_that_is_not_utf8_is_a_bad_row_and_blank_lines_are_skipped")),
    ("dirs", "a Hugging Face cache that cannot be written (download, train): named", Test("fault_corpus::a_hub_cache_that_cannot_be_written_is_named")),
    // closed pipes
    ("pipes", "a command's stdout closed (`check | head -1`): quiet, status 0", Test("output_streams::a_closed_stdout_ends_a_command_quietly_with_status_0")),
    ("pipes", "a run whose stdout reader is gone keeps its adapter, exit 0", Test("output_streams::a_run_whose_stdout_reader_is_gone_keeps_its_adapter_and_exit_0")),
    ("pipes", "a run whose log reader goes away stops with a checkpoint that resumes", Test("output_streams::a_run_whose_log_reader_goes_away_stops_with_a_checkpoint_that_resumes")),
    ("pipes", "generate streaming into a closed pipe: quiet, status 0", Test("fault_corpus::generate_into_a_closed_pipe_ends_quietly_with_status_0")),
    // unknown recipe keys
    ("keys", "an unknown key in a section: named, with the keys it could be", Test("cli::bad_recipes_exit_2_with_the_file_the_key_and_the_fix")),
    ("keys", "an unknown section and an unknown --set key: named, exit 2", Test("fault_corpus::unknown_sections_and_set_keys_exit_2_naming_them")),
    ("keys", "a value of the wrong kind or an unknown variant: named with what it may be", Test("cli::bad_recipes_exit_2_with_the_file_the_key_and_the_fix")),
];

/// How many cases a test or a lie holds (the figure `scripts/fault_corpus.sh` reports when
/// every named test passes).
const HANDLED: usize = 79;

/// The functions marked #[test] in tests/it/`module`.rs.
fn tests_of(module: &str) -> Vec<String> {
    let text = std::fs::read_to_string(root().join(format!("tests/it/{module}.rs")))
        .unwrap_or_else(|e| panic!("tests/it/{module}.rs: {e}"));
    let lines: Vec<&str> = text.lines().collect();
    lines
        .windows(2)
        .filter(|w| w[0].trim() == "#[test]")
        .filter_map(|w| {
            let f = w[1].trim().strip_prefix("fn ")?;
            Some(f.split('(').next()?.to_string())
        })
        .collect()
}

#[test]
fn the_corpus_names_tests_that_exist() {
    let lies = std::fs::read_to_string(root().join("tests/it/hub_faults.rs")).unwrap();
    let mut handled = 0;
    for (area, case, by) in &CASES {
        match by {
            Test(t) => {
                let (module, f) = t.split_once("::").unwrap();
                assert!(
                    tests_of(module).iter().any(|x| x == f),
                    "{area}: {case}: no test {t}"
                );
                handled += 1;
            }
            Lie(name) => {
                assert!(
                    lies.contains(&format!("\"{name}\"")),
                    "{area}: {case}: hub_faults has no lie {name:?}"
                );
                handled += 1;
            }
            Open(why) => assert!(!why.is_empty()),
        }
    }
    assert_eq!(handled, HANDLED, "update HANDLED (and the figure reported)");
    let mut cases: Vec<&str> = CASES.iter().map(|c| c.1).collect();
    cases.sort();
    cases.dedup();
    assert_eq!(cases.len(), CASES.len(), "each case once");
}

fn bin() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin("lora-train"));
    c.current_dir(root());
    c
}

#[test]
fn unknown_sections_and_set_keys_exit_2_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(root().join("recipes/tiny-cpu.toml")).unwrap();
    let recipe = tmp.path().join("r.toml");
    std::fs::write(&recipe, format!("{text}\n[trian]\nlr = 1e-3\n")).unwrap();
    let o = bin()
        .arg("check")
        .arg("--recipe")
        .arg(&recipe)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown field `trian`"), "{err}");
    let o = bin()
        .args([
            "check",
            "--recipe",
            "recipes/tiny-cpu.toml",
            "--set",
            "train.lrr=1e-3",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--set train.lrr=1e-3") && err.contains("unknown field `lrr`"),
        "{err}"
    );
}

/// A recipe on the Hub model `tiny/m` (the data local), training into `out`.
fn hub_recipe(dir: &std::path::Path) -> std::path::PathBuf {
    let data = root().join("recipes/data/tiny-text.jsonl");
    let text = format!(
        "[model]\nid = \"tiny/m\"\ndevice = \"cpu\"\ndtype = \"f32\"\n\n[data]\ntrain = \"{}\"\n\
         format = \"text\"\nseq_len = 64\n\n[output]\ndir = \"{}\"\n",
        data.display(),
        dir.join("run").display()
    );
    let r = dir.join("hub.toml");
    std::fs::write(&r, text).unwrap();
    r
}

/// `cmd` with no Hub home but `home` (None: none at all) and an endpoint nothing answers.
fn hub_env(cmd: &mut Command, home: Option<&str>) {
    for v in [
        "HOME",
        "HF_HOME",
        "HF_HUB_CACHE",
        "XDG_CACHE_HOME",
        "HF_TOKEN",
    ] {
        cmd.env_remove(v);
    }
    cmd.env("HF_ENDPOINT", "http://127.0.0.1:9");
    if let Some(h) = home {
        cmd.env("HF_HOME", h);
    }
}

#[test]
fn train_on_a_hub_model_without_a_home_names_the_variable_to_set() {
    let tmp = tempfile::tempdir().unwrap();
    let mut c = bin();
    c.arg("train").arg("--recipe").arg(hub_recipe(tmp.path()));
    hub_env(&mut c, None);
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot place the Hugging Face cache")
            && err.contains("set HF_HOME to a directory"),
        "{err}"
    );
    assert!(!tmp.path().join("run/adapter_model.safetensors").exists());
}

#[test]
fn a_hub_cache_that_cannot_be_written_is_named() {
    for args in [&["download", "tiny/m"][..], &["train", "--recipe"]] {
        let tmp = tempfile::tempdir().unwrap();
        let mut c = bin();
        c.args(args);
        if args[0] == "train" {
            c.arg(hub_recipe(tmp.path()));
        }
        hub_env(&mut c, Some("/proc/lt-read-only"));
        let o = c.output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("/proc/lt-read-only/hub"), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn generate_into_a_closed_pipe_ends_quietly_with_status_0() {
    let (r, w) = crate::common::pipe();
    drop(r);
    let o = bin()
        .args(["generate", "--model", "recipes/assets/tiny-llama"])
        .args(["--prompt", "Once", "--max-new-tokens", "40"])
        .stdout(w)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked") && !err.contains("error"), "{err}");
}

/// A write that fails inside a checkpoint (the file-size limit with SIGXFSZ ignored: the
/// write returns EFBIG, as a full disk returns ENOSPC): the run stops with an error naming the
/// file, the earlier checkpoint byte for byte as it was and the only one, and a resume from it
/// trains on.
#[test]
fn a_write_that_fails_inside_a_checkpoint_stops_the_run_and_keeps_the_earlier_one() {
    use std::os::unix::process::CommandExt;
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let args = |resume: &str| {
        let mut c = bin();
        c.args(["train", "--recipe", "recipes/tiny-cpu.toml", "--set"])
            .arg(format!("output.dir={}", out.display()))
            .args([
                "--set",
                "train.max_steps=20",
                "--set",
                "output.save_every=5",
            ])
            .args([
                "--set",
                "train.micro_batch=1",
                "--set",
                "train.grad_accum=20",
            ])
            .args(["--set", "train.log_every=1", "--set"])
            .arg(format!("train.resume={resume}"));
        c
    };
    let mut c = args("false");
    // SAFETY: signal() only, between fork and exec (async-signal-safe); an ignored
    // disposition survives exec.
    unsafe {
        c.pre_exec(|| {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            Ok(())
        });
    }
    let child = c
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let ck5 = out.join("checkpoint-5");
    crate::common::wait_until("checkpoint-5", || ck5.join("trainer_state.json").is_file());
    let files = [
        "adapter_model.safetensors",
        "optimizer.safetensors",
        "trainer_state.json",
    ];
    let saved: Vec<Vec<u8>> = files
        .iter()
        .map(|f| std::fs::read(ck5.join(f)).unwrap())
        .collect();
    let lim = libc::rlimit {
        rlim_cur: saved[1].len() as u64 - 1000,
        rlim_max: saved[1].len() as u64 - 1000,
    };
    // SAFETY: prlimit on a child of ours with a valid limit and no old-limit output.
    let rc = unsafe {
        libc::prlimit(
            child.id() as i32,
            libc::RLIMIT_FSIZE,
            &lim,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("File too large"), "{err}");
    assert!(err.contains("optimizer.safetensors"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    for (f, b) in files.iter().zip(&saved) {
        assert!(std::fs::read(ck5.join(f)).unwrap() == *b, "{f} changed");
    }
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    assert_eq!(names, ["checkpoint-5"]);
    let o = args(&ck5.display().to_string()).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("resuming from"), "{err}");
    assert!(out.join("checkpoint-20/trainer_state.json").is_file());
}

/// A run killed inside its final merge (`output.merge = true`; the kernel's SIGXFSZ at a
/// file-size limit above the adapter and the optimizer state, below the merged weights): its
/// adapter is complete, `merged/` absent, its temporary hidden; the next export to that
/// `--out` removes the temporary and writes the merged model.
#[test]
fn a_run_killed_inside_its_merge_leaves_a_temporary_the_next_export_removes() {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut c = bin();
    c.args(["train", "--recipe", "recipes/tiny-cpu.toml", "--set"])
        .arg(format!("output.dir={}", out.display()))
        .args(["--set", "train.max_steps=2", "--set", "output.merge=true"])
        .env("LORA_TRAIN_CACHE", "off");
    let limit: u64 = 400_000;
    // SAFETY: setrlimit only, between fork and exec (async-signal-safe).
    unsafe {
        c.pre_exec(move || {
            let l = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            libc::setrlimit(libc::RLIMIT_FSIZE, &l);
            let core = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::setrlimit(libc::RLIMIT_CORE, &core);
            Ok(())
        });
    }
    let o = c.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGXFSZ),
        "{:?} {err}",
        o.status
    );
    let adapter = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
    assert!((adapter.len() as u64) < limit);
    assert!(!out.join("merged").exists());
    let temporaries = || -> Vec<String> {
        std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".merged.tmp-"))
            .collect()
    };
    assert_eq!(temporaries().len(), 1, "{:?}", temporaries());
    let o = bin()
        .args(["export", "--adapter"])
        .arg(&out)
        .args(["--base", "recipes/assets/tiny-llama", "--out"])
        .arg(out.join("merged"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.join("merged/config.json").is_file());
    assert_eq!(temporaries(), Vec::<String>::new());
}
