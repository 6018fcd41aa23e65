"""Click options shared by several commands, declared once."""

from __future__ import annotations

import click

from dspark_trt.runtime.backends.base import BACKENDS

backend_option = click.option("--backend", default="ort", type=click.Choice(list(BACKENDS)), help="Execution backend.")


def generation_options(f):
    """--backend, --spec, --temperature, --max-new-tokens, --seed (generate)."""
    for decorator in reversed([
        backend_option,
        click.option("--spec", default="adaptive", help="Speculation: off | fixed:K | adaptive."),
        click.option("--temperature", default=0.0, type=click.FloatRange(0.0), help="0 = greedy."),
        click.option("--max-new-tokens", default=64, type=click.IntRange(1), help="Tokens to generate per prompt."),
        click.option("--seed", default=0, type=int, help="Seed for sampling."),
    ]):
        f = decorator(f)
    return f
