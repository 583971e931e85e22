#!/usr/bin/env python3
"""TensorBoard's own event-file bytes for fixed scalars, for src/track's encoding test.

    pip install tensorboard
    python3 scripts/make_tensorboard_fixture.py   # -> tests/fixtures/tensorboard/scalars.tfevents

TensorBoard's `EventFileWriter` (tensorboard.summary.writer.event_file_writer: its
RecordWriter frames each record, protobuf serializes each Event) writes, with its clock held at
fixed times: the file-version event it starts every file with, a SessionLog START at step 1 (what
lora-train writes when a run starts or resumes), and scalar events as torch's and transformers'
writers make them (Summary.Value tag + simple_value): a row of several tags, a zero value, a
negative one, step 0 (left out on the wire), a step past 2^32 and a 200-byte tag (multi-byte
varints), a NaN-free float32 rounding case. tests/it/track.rs encodes the same events with
src/track/event.rs + tfrecord.rs and asserts equal bytes, then decodes the fixture with our
reader. The committed file was made with tensorboard 2.21.0 and protobuf 7.36.2.
"""
import glob
import os
import shutil
import tempfile

import tensorboard
from google.protobuf import __version__ as protobuf_version
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer import event_file_writer

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "tensorboard")
T0 = 1700000000.25

# (wall_time, step, [(tag, value)]): tests/it/track.rs holds the same list.
ROWS = [
    (T0 + 1.5, 1, [("train/loss", 3.25), ("train/learning_rate", 0.0003), ("train/grad_norm", 1.0)]),
    (T0 + 2.75, 2, [("train/loss", 2.9375), ("eval/loss", 0.0)]),
    (T0 + 3.0, 0, [("rewards/chosen", -0.125)]),
    (T0 + 4.125, 5_000_000_000, [("x" * 200, 123456.789)]),
]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        event_file_writer.time.time = lambda: T0
        w = event_file_writer.EventFileWriter(tmp)
        w.add_event(event_pb2.Event(wall_time=T0, step=1,
                                    session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        for wall, step, scalars in ROWS:
            values = [summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in scalars]
            w.add_event(event_pb2.Event(wall_time=wall, step=step, summary=summary_pb2.Summary(value=values)))
        w.close()
        (path,) = glob.glob(os.path.join(tmp, "events.out.tfevents.*"))
        os.makedirs(OUT, exist_ok=True)
        shutil.copyfile(path, os.path.join(OUT, "scalars.tfevents"))
    print(f"wrote {OUT}/scalars.tfevents (tensorboard {tensorboard.__version__}, protobuf {protobuf_version})")


if __name__ == "__main__":
    main()
