"""Click options shared by several commands, declared once."""

from __future__ import annotations

import click

from dspark_trt.runtime.backends.base import BACKENDS

backend_option = click.option("--backend", default="ort", type=click.Choice(list(BACKENDS)), help="Execution backend.")
