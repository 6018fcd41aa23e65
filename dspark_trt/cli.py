"""The `dspark-trt` command line: each command is a thin shell over a library call."""

from __future__ import annotations

import json
import sys

import click

from dspark_trt import __version__
from dspark_trt.commands.options import backend_option, generation_options
from dspark_trt.errors import DsparkError

CONTEXT = {"show_default": True, "help_option_names": ["-h", "--help"]}


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="dspark-trt")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Adaptive speculative decoding: export, build, run, benchmark and serve."""
    ctx.obj = {"debug": debug}


@cli.command()
@click.option("--target", "target_dir", required=True, type=click.Path(), help="Target model directory (HF layout).")
@click.option("--draft", "draft_dir", required=True, type=click.Path(),
              help="Draft model directory (HF layout), or a DSpark drafter in vLLM's format.")
@click.option("--head", "head_dir", type=click.Path(), default=None,
              help="Head directory written by train-head or calibrate (default: the draft directory's head, if present).")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Artifact directory to write.")
@click.option("--max-draft", default=7, type=click.IntRange(1, 32),
              help="Maximum draft length K (a DSpark drafter: its block size, this option does not apply).")
@click.option("--max-batch", default=64, type=click.IntRange(1, 4096), help="Maximum concurrent requests.")
@click.option("--max-context", default=1024, type=click.IntRange(16, 1 << 20), help="Maximum context length.")
@click.option("--dtype", default="fp32", type=click.Choice(["fp32", "fp16", "bf16"]), help="Precision of the exported graphs.")
@click.option("--external-data", default="auto", type=click.Choice(["auto", "always", "never"]),
              help="Weights in <graph>.onnx.data beside each graph: auto = when a graph's weights exceed 1 GiB.")
@click.option("--ort-flavour", default="fused", type=click.Choice(["fused", "none"]),
              help="Also write draft.ort.onnx / target.ort.onnx, the graphs the ORT backend runs: fused = fewer "
                   "nodes (ONNX Runtime contrib ops); none = ORT runs the standard graphs. TensorRT always builds "
                   "from the standard graphs.")
@click.option("--force", is_flag=True, help="Overwrite an existing artifact directory.")
@click.option("--allow-large-draft", is_flag=True,
              help="Export even when the draft has more parameters, layers or hidden width than the target.")
def export(target_dir, draft_dir, head_dir, out_dir, max_draft, max_batch, max_context, dtype, external_data,
           ort_flavour, force, allow_large_draft):
    """Export target and draft to ONNX with dspark custom ops, plus a manifest."""
    from dspark_trt.exporter.export import export_artifacts

    out = export_artifacts(target_dir, draft_dir, out_dir, head_dir=head_dir, max_draft=max_draft,
                           max_batch=max_batch, max_context=max_context, dtype=dtype, overwrite=force,
                           allow_large_draft=allow_large_draft, external_data=external_data,
                           ort_flavour=ort_flavour)
    click.echo(f"wrote {out}")


@cli.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--trt-version", default=None, help="TensorRT version to lint against (default: the bundled list).")
def check(artifact_dir, trt_version):
    """Check an artifact directory: manifest, hashes, ONNX checker, TensorRT lint."""
    from dspark_trt.exporter.check import check_artifacts

    report = check_artifacts(artifact_dir, trt_version=trt_version)
    for line in report.summary_lines():
        click.echo(line)
    if not report.ok:
        for problem in report.problems:
            click.echo(f"problem: {problem}", err=True)
        sys.exit(1)


@cli.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--out", "out_dir", default=None, type=click.Path(), help="Engine directory (default: ARTIFACT_DIR/engines).")
@click.option("--dry-run", is_flag=True, help="Print the build plan without TensorRT.")
@click.option("--plugin-mode", default="aot", type=click.Choice(["aot", "jit"]), help="Preferred plugin implementation.")
def build(artifact_dir, out_dir, dry_run, plugin_mode):
    """Build TensorRT engines for the draft and target graphs."""
    from dspark_trt.exporter.build import build_engines, plan_build

    if dry_run:
        click.echo(json.dumps(plan_build(artifact_dir, out_dir=out_dir, plugin_mode=plugin_mode), indent=2))
        return
    for path in build_engines(artifact_dir, out_dir=out_dir, plugin_mode=plugin_mode):
        click.echo(f"wrote {path}")


@cli.command()
@click.argument("artifact_dir", type=click.Path())
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable).")
@click.option("--prompts-file", type=click.Path(), default=None, help="A text file (one prompt per line) or JSONL with a 'prompt' field.")
@generation_options
@click.option("--compare", is_flag=True, help="Also run without speculation and print the speed-up.")
@click.option("--json", "as_json", is_flag=True, help="Print results as JSON.")
def generate(artifact_dir, prompts, prompts_file, backend, spec, temperature, max_new_tokens, seed, compare, as_json):
    """Generate text with (adaptive) speculative decoding."""
    from dspark_trt.commands.generate import run_generate

    run_generate(artifact_dir, list(prompts), prompts_file, backend=backend, spec=spec, temperature=temperature,
                 max_new_tokens=max_new_tokens, seed=seed, compare=compare, as_json=as_json, echo=click.echo)


@cli.command()
@click.argument("artifact_dir", type=click.Path())
@backend_option
@click.option("--repeats", default=5, type=click.IntRange(1), help="Repeats per point, at least (more while its timings spread; a low quantile is kept).")
@click.option("--context", default=None, type=int,
              help="Cached tokens per row in the profiled calls (default 128; a serving context is more realistic).")
@click.option("--force", is_flag=True, help="Save the profile even if its timings spread too much (busy machine).")
@click.option("--out", default=None, type=click.Path(dir_okay=False),
              help="Write the profile here instead of next to the artifact, which keeps its own "
                   "(e.g. one recorded under load, for `bench --start-profile`); never overwrites a file.")
def profile(artifact_dir, backend, repeats, context, force, out):
    """Measure verify/draft step costs and save cost_profile.json."""
    from dspark_trt.commands.profile import profile_artifact

    path = profile_artifact(artifact_dir, backend=backend, repeats=repeats, context=context, force=force, out=out)
    click.echo(f"wrote {path}")


@cli.command("train-head")
@click.option("--target", "target_dir", required=True, type=click.Path())
@click.option("--draft", "draft_dir", required=True, type=click.Path())
@click.option("--data", required=True, type=click.Path(),
              help="Directory of text/code files, a JSONL of prompts, or stdlib:train / stdlib:heldout.")
@click.option("--out", "out_dir", default=None, type=click.Path(),
              help="New head directory to write (required; the model directories are never modified).")
@click.option("--max-draft", default=7, type=click.IntRange(1, 32))
@click.option("--steps", default=2000, type=click.IntRange(1))
@click.option("--rank", default=64, type=click.IntRange(1), help="Rank of the previous-token embedding.")
@click.option("--labels", default="expected", type=click.Choice(["expected", "greedy"]), help="Soft 1-TV labels or greedy exact match.")
@click.option("--stats", "stats", default="log_max_prob,entropy,log_margin",
              help="Statistics of the draft's own distribution the head also sees (comma-separated), or 'none' "
                   "for the plain DSpark head on [h ; e(x_prev)].")
@click.option("--contexts", "num_contexts", default=None, type=click.IntRange(1),
              help="Contexts rolled out for training (x max-draft labelled positions) [default: 4096].")
@click.option("--prev-embed/--no-prev-embed", default=True,
              help="Learn the previous-token embedding e(x_prev) (default), or keep it at zero: the head is then "
                   "sigmoid(w . [h ; s] + b) in the same exported form. A learned table overfits rare tokens "
                   "with little data (the bundled head uses --no-prev-embed).")
@click.option("--seed", default=0, type=int)
@click.option("--force", is_flag=True, help="Replace a head already in --out.")
def train_head(target_dir, draft_dir, data, out_dir, max_draft, steps, rank, labels, stats, num_contexts, prev_embed,
               seed, force):
    """Train the confidence head on real acceptance labels."""
    from dspark_trt.training.head_training import train_head as run

    names = [] if stats.strip().lower() in ("", "none") else [n.strip() for n in stats.split(",") if n.strip()]
    path = run(target_dir, draft_dir, data, out_dir=out_dir, max_draft=max_draft, steps=steps, rank=rank,
               labels=labels, seed=seed, overwrite=force, stats=names, num_contexts=num_contexts,
               prev_embed=prev_embed)
    click.echo(f"wrote {path}")


@cli.command()
@click.option("--target", "target_dir", required=True, type=click.Path())
@click.option("--draft", "draft_dir", required=True, type=click.Path())
@click.option("--head", "head_dir", default=None, type=click.Path(), help="Head directory (default: the draft directory).")
@click.option("--data", required=True, type=click.Path(),
              help="Held-out directory of text/code files, a JSONL, or stdlib:heldout.")
@click.option("--out", "out_dir", default=None, type=click.Path(),
              help="New head directory for the calibrated head (required; --head is never modified).")
@click.option("--force", is_flag=True, help="Replace a head already in --out.")
@click.option("--report", default=None, type=click.Path(), help="Write the calibration report (JSON; PNGs beside it).")
@click.option("--max-draft", default=7, type=click.IntRange(1, 32))
@click.option("--contexts", "num_contexts", default=None, type=click.IntRange(1),
              help="Held-out contexts rolled out (per position n; ECE's sampling noise shrinks as 1/sqrt(n)) "
                   "[default: 2048].")
@click.option("--seed", default=0, type=int)
def calibrate(target_dir, draft_dir, head_dir, data, out_dir, force, report, max_draft, num_contexts, seed):
    """Sequential temperature scaling of the confidence head into a new head directory, with a report."""
    from dspark_trt.training.calibration import calibrate as run
    from dspark_trt.training.head_output import check_head_out

    if out_dir is None:
        check_head_out(None, force, {}, "calibrate")  # the error that says to pass --out
    result = run(target_dir, draft_dir, data, head_dir=head_dir, report_path=report, max_draft=max_draft, seed=seed,
                 num_contexts=num_contexts, out_dir=out_dir, overwrite=force)
    for line in result.table_lines():
        click.echo(line)


@cli.command()
@click.argument("artifact_dir", type=click.Path())
@backend_option
@click.option("--concurrency", default="1,2,4,8,16,32,64", help="Comma-separated concurrency levels (closed loop).")
@click.option("--rates", default=None,
              help="Open loop: Poisson arrival rates in requests/s (1,2,4), multiples of the measured capacity "
                   "(0.5x,2x), or auto. Replaces the closed loop (--concurrency).")
@click.option("--capacity", default=None,
              help="Open loop: the capacity that relative rates (0.5x) multiply, in requests/s or as an earlier "
                   "run's results.json, instead of measuring it (so 0.5x means the same load in every run).")
@click.option("--modes", default="off,fixed:1,fixed:2,fixed:3,fixed:4,fixed:5,fixed:6,fixed:7,adaptive")
@click.option("--num-prompts", default=64, type=click.IntRange(1),
              help="Closed loop: prompts. Open loop: requests per (rate, mode) run, instead of --duration.")
@click.option("--duration", default=None, type=click.FloatRange(0.0, min_open=True),
              help="Open loop: seconds of arrivals per (rate, mode) run [default: 30, --quick 6].")
@click.option("--max-new-tokens", default=64, type=click.IntRange(1), help="Closed loop: tokens per request.")
@click.option("--workload", default="mixed",
              help="Open loop: mixed | short, optionally :prompt=LO-HI,out=LO-HI (docs/open-loop.md).")
@click.option("--temperature", default="0",
              help="0 = greedy. Open loop: also a mix T:WEIGHT,... such as 0:0.5,1.0:0.5 (drawn per request).")
@click.option("--slo-ttft-ms", default=None, type=click.FloatRange(0.0, min_open=True),
              help="Open loop goodput: time-to-first-token limit [default: 1000].")
@click.option("--slo-tpot-ms", default=None, type=click.FloatRange(0.0, min_open=True),
              help="Open loop goodput: time-per-output-token limit [default: 50].")
@click.option("--via-http", is_flag=True,
              help="Open loop through a `dspark-trt serve` subprocess, streaming over HTTP (implies --rates auto).")
@click.option("--api-key", default=None, envvar="DSPARK_API_KEY", show_envvar=True,
              help="With --via-http: passed to the server and sent as a bearer token.")
@click.option("--seed", default=0, type=int)
@click.option("--prompts-file", default=None, type=click.Path())
@click.option("--out", "out_dir", default="bench-results", type=click.Path())
@click.option("--quick", is_flag=True,
              help="Small preset for smoke tests (under 3 minutes); replaces --concurrency/--modes/--num-prompts/"
                   "--max-new-tokens left at their defaults. Open loop: two rates (0.5x, 2x capacity), 6 s each, "
                   "the short workload, under 2 minutes.")
@click.option("--peers", is_flag=True,
              help="Also run other engines on the same checkpoints and prompts (--peer-engines): transformers at "
                   "batch 1, onnxruntime-genai and vLLM at every concurrency.")
@click.option("--peer-engines", default="auto", show_default=True,
              help="With --peers: hf, ortgenai, vllm (comma-separated), or auto = each one installed (the others "
                   "are skipped with a note). Implies --peers.")
@click.option("--peer-python", default=None, type=click.Path(dir_okay=False),
              help="Python that runs the onnxruntime-genai and vLLM peers (e.g. another venv's bin/python) "
                   "[default: this one].")
@click.option("--rounds", default=1, type=click.IntRange(1),
              help="Repeat every (mode, concurrency) run, modes rotated. From 2 rounds adaptive / best gets a "
                   "confidence interval (94% at 5); many rounds of two modes (--modes fixed:2,adaptive) "
                   "resolve a close pair.")
@click.option("--force", is_flag=True, help="Overwrite results already in --out (default: write a new run-* subdirectory).")
@click.option("--start-profile", default=None, type=click.Path(dir_okay=False),
              help="Every run starts cold from this cost profile on a runtime of its own (recovery from a "
                   "wrong profile; consecutive open loops start alike; `dspark-trt profile --out FILE` "
                   "records one). In process only.")
@click.pass_context
def bench(ctx, artifact_dir, backend, concurrency, rates, capacity, modes, num_prompts, duration, max_new_tokens,
          workload, temperature, slo_ttft_ms, slo_tpot_ms, via_http, api_key, seed, prompts_file, out_dir, quick, peers,
          peer_engines, peer_python, rounds, force, start_profile):
    """Benchmark every speculation mode: throughput vs concurrency (closed loop), or latency and goodput
    under Poisson arrivals (open loop: --rates, --via-http)."""
    command = "dspark-trt " + " ".join(_redact_secrets(sys.argv[1:]))

    def given(name):
        return ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT,
                                                      click.core.ParameterSource.ENVIRONMENT)

    if rates is not None or via_http:
        from dspark_trt.bench.open_loop import run_open_loop
        from dspark_trt.bench.options import DEFAULT_MODES, OPEN_QUICK

        for name in ("concurrency", "max_new_tokens", "peers", "peer_engines", "peer_python"):
            if given(name):
                raise DsparkError(f"--{name.replace('_', '-')} belongs to the closed loop; the open loop (--rates, "
                                  f"--via-http) takes arrival rates, and output lengths from --workload")
        path = run_open_loop(artifact_dir, backend=backend, rates=rates or "auto",
                             modes=OPEN_QUICK["modes"] if quick and modes == DEFAULT_MODES else modes,
                             workload=OPEN_QUICK["workload"] if quick and workload == "mixed" else workload,
                             temperature=temperature, num_prompts=num_prompts if given("num_prompts") else None,
                             duration=duration,
                             rounds=rounds, seed=seed, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                             via_http=via_http, api_key=api_key, prompts_file=prompts_file, out_dir=out_dir,
                             quick=quick, force=force, echo=click.echo, command=command, capacity=capacity,
                             start_profile=start_profile)
        click.echo(f"wrote {path}")
        return
    from dspark_trt.bench.harness import run_bench

    for name in ("duration", "workload", "slo_ttft_ms", "slo_tpot_ms", "api_key", "capacity"):
        if given(name):
            raise DsparkError(f"--{name.replace('_', '-')} belongs to the open loop: add --rates (or --via-http)")
    try:
        temp = float(temperature)
    except ValueError:
        raise DsparkError(f"--temperature {temperature!r}: the closed loop takes one value (a mix such as "
                          f"0:0.5,1.0:0.5 needs the open loop: add --rates)") from None
    if not temp >= 0:
        raise DsparkError(f"--temperature must be >= 0, got {temperature}")
    path = run_bench(artifact_dir, backend=backend, concurrency=concurrency, modes=modes, num_prompts=num_prompts,
                     max_new_tokens=max_new_tokens, temperature=temp, seed=seed, prompts_file=prompts_file,
                     out_dir=out_dir, quick=quick, peers=peers or given("peer_engines") or given("peer_python"),
                     echo=click.echo, rounds=rounds, force=force, command=command, peer_engines=peer_engines,
                     peer_python=peer_python, start_profile=start_profile)
    click.echo(f"wrote {path}")


@cli.command()
@click.argument("artifact_dir", type=click.Path())
@backend_option
@click.option("--host", default="127.0.0.1")
@click.option("--port", default=8000, type=click.IntRange(0, 65535))
@click.option("--max-batch", default=None, type=click.IntRange(1), help="Concurrent requests (default: the manifest's).")
@click.option("--max-context", default=None, type=click.IntRange(16),
              help="Context length (default: the manifest's; may only lower it, and shrinks the KV cache).")
@click.option("--max-queue", default=256, type=click.IntRange(1), help="Queued requests before answering 429.")
@click.option("--api-key", default=None, envvar="DSPARK_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every route but /health (401 otherwise).")
@click.option("--max-body-mb", default=2.0, type=click.FloatRange(0.001), show_default=True,
              help="Largest request body in MiB (413 beyond it).")
@click.option("--header-timeout", default=10.0, type=click.FloatRange(0.1), show_default=True,
              help="Seconds a connection has to send a complete request head (slowloris guard).")
@click.option("--body-timeout", default=30.0, type=click.FloatRange(0.1), show_default=True,
              help="Seconds a request body has to arrive completely (408 beyond it).")
@click.option("--keep-alive", default=5.0, type=click.FloatRange(0.1), show_default=True,
              help="Seconds an idle keep-alive connection is kept open.")
@click.option("--shutdown-grace", default=5.0, type=click.FloatRange(0), show_default=True,
              help="On SIGTERM/Ctrl-C, seconds live requests get to finish before they end with an error event.")
def serve(artifact_dir, backend, host, port, max_batch, max_context, max_queue, api_key, max_body_mb, header_timeout,
          body_timeout, keep_alive, shutdown_grace):
    """Serve an OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
    from dspark_trt.serve.limits import ServeLimits
    from dspark_trt.serve.server import serve as run

    limits = ServeLimits(max_body_bytes=max(1, int(max_body_mb * 1024 * 1024)), header_timeout_s=header_timeout,
                         body_timeout_s=body_timeout, keep_alive_s=keep_alive, shutdown_grace_s=shutdown_grace,
                         api_key=api_key or None)
    run(artifact_dir, backend=backend, host=host, port=port, max_batch=max_batch, max_queue=max_queue,
        limits=limits, max_context=max_context)


def _redact_secrets(args: list[str]) -> list[str]:
    """The command line as recorded in results files, with the value of --api-key hidden."""
    out, hide = [], False
    for a in args:
        if hide:
            out.append("***")
        elif a.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(a)
        hide = a == "--api-key"
    return out


def main(argv=None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, prog_name="dspark-trt", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(1)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except DsparkError as e:
        if debug:
            raise
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except OSError as e:  # the environment, not a bug: a full disk, a file removed underneath, no permission
        if debug:
            raise
        where = f": {e.filename}" if e.filename else ""
        click.echo(f"error: {e.strerror or e}{where} (run with --debug for the traceback)", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
