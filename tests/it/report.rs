//! `report`: a synthetic metrics.jsonl (a resumed run, eval rows, memory rows of two ranks, bad
//! lines) → the summary's numbers and an SVG with every panel; the real binary on it.

use crate::common::root;
use assert_cmd::Command;
use lora_train::report::{self, plot::TITLES};

/// 10 steps over two sessions (the clock restarts at step 6), eval at 5 and 10, memory rows,
/// a line that is not JSON and a truncated last line.
fn metrics() -> String {
    let mut s = String::new();
    for step in 1..=10usize {
        let session = if step <= 5 { step } else { step - 5 };
        let mut row = serde_json::json!({
            "step": step, "epoch": 0, "loss": 3.0 - 0.2 * step as f64, "lr": 1e-4 * step as f64,
            "grad_norm": 1.0, "tokens": 1000 * step, "target_tokens": 900, "tok_per_s": 500.0,
            "elapsed_s": 2.0 * session as f64, "skipped": false,
        });
        if step % 5 == 0 {
            row["eval_loss"] = (2.5 - 0.01 * step as f64).into();
            row["eval_tokens"] = 400.into();
        }
        row["mem"] = serde_json::json!({
            "rank": 0, "load_gib": 1.5, "forward_gib": 2.0 + 0.125 * step as f64,
            "head_gib": 2.5, "backward_gib": 3.0, "optimizer_gib": 1.75,
        });
        s.push_str(&format!("{row}\n"));
        if step == 3 {
            s.push_str("garbage line\n");
            s.push_str(
                &serde_json::json!({"step": 3, "mem": {"rank": 1, "backward_gib": 7.25}})
                    .to_string(),
            );
            s.push('\n');
        }
    }
    s.push_str("{\"step\": 11, \"loss\": 0.");
    s
}

#[test]
fn summary_numbers_and_the_svg_panels() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("metrics.jsonl"), metrics()).unwrap();
    let (s, out) = report::report(tmp.path(), None).unwrap();
    assert_eq!(out, tmp.path().join("report.svg"));
    assert_eq!((s.steps, s.rows, s.tokens), (10, 11, Some(10_000)));
    assert_eq!(s.elapsed_s, 20.0, "two sessions of 10 s");
    assert_eq!(s.first_loss, Some(2.8));
    assert!((s.final_loss.unwrap() - 1.0).abs() < 1e-12);
    assert_eq!(s.best_eval, Some((2.4, 10)));
    assert_eq!(s.peak_mem[&0], (3.25, "forward"));
    assert_eq!(s.peak_mem[&1], (7.25, "backward"));
    assert_eq!((s.bad_lines, s.first_bad), (2, Some(4)));
    let text = s.to_string();
    for want in [
        "10 steps (11 rows), 10.0k tokens in 20.0s (500 tok/s)",
        "best eval loss 2.4000 at step 10",
        "peak memory rank 1: 7.25 GiB (backward)",
        "skipped 2 line(s)",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..80.min(svg.len())]);
    for t in TITLES {
        assert!(svg.contains(t), "panel {t:?} missing");
    }
    // legends: train and eval loss, both ranks' phases
    for l in ["train", "eval", "rank 1 backward", "rank 0 optimizer"] {
        assert!(svg.contains(l), "legend {l:?} missing");
    }
}

#[test]
fn empty_and_cpu_runs_draw_without_panicking() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("metrics.jsonl"), "").unwrap();
    let (s, out) = report::report(tmp.path(), Some(&tmp.path().join("x.svg"))).unwrap();
    assert_eq!((s.steps, s.rows), (0, 0));
    let svg = std::fs::read_to_string(out).unwrap();
    assert!(svg.contains("no data"));
    // One CPU row: no memory, one point a line.
    let row = r#"{"step":1,"loss":2.0,"lr":0.001,"tokens":10,"tok_per_s":5.0,"elapsed_s":2.0}"#;
    std::fs::write(tmp.path().join("metrics.jsonl"), format!("{row}\n")).unwrap();
    let (s, out) = report::report(tmp.path(), None).unwrap();
    assert!(s.to_string().contains("not recorded"), "{s}");
    assert!(std::fs::read_to_string(out)
        .unwrap()
        .contains("recorded on CUDA only"));
}

#[test]
fn cli_report_prints_the_summary_and_names_missing_files() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("metrics.jsonl"), metrics()).unwrap();
    let bin = || Command::cargo_bin("lora-train").unwrap();
    let o = bin()
        .current_dir(root())
        .arg("report")
        .arg(tmp.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        stdout.contains("10 steps") && stdout.contains("wrote"),
        "{stdout}"
    );
    assert!(tmp.path().join("report.svg").is_file());
    let o = bin()
        .arg("report")
        .arg(tmp.path().join("nope"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let empty = tempfile::tempdir().unwrap();
    let o = bin().arg("report").arg(empty.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("metrics.jsonl does not exist"), "{stderr}");
}
