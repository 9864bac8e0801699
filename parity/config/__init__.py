"""parity's settings, one concept per module; this package's names are the public ones.

    fields.py      how a field is declared and checked (types, bounds, `check_fields`, `coerce`)
    run.py         `Config`: the one typed config of a run, and the rules across its fields
    recipes.py     named presets of Config, and `make_config` (defaults < recipe < task < YAML
                   < flags)
    audit.py       `AuditSettings`: what `parity audit` measures, Config's fields where shared
    yaml_files.py  config files in and out

Each module imports only those above it in this list, so the package has no cycle.
"""

from parity.config.audit import AuditSettings
from parity.config.fields import (
    CORRECTIONS,
    DTYPES,
    RATIO_SOURCES,
    Correction,
    CpuFp16,
    Dtype,
    RatioSource,
    ShadowKernels,
    check_fields,
    check_value,
    coerce,
    field_specs,
    own,
    quoted,
)
from parity.config.recipes import RECIPE_FIELDS, RECIPES, Recipe, make_config, recipe
from parity.config.run import (
    FIELDS,
    TASK_DEFAULTS,
    Config,
    SamplingArgs,
    engine_needs,
    shared,
)
from parity.config.yaml_files import dump_yaml, load_yaml

__all__ = ["CORRECTIONS", "DTYPES", "FIELDS", "RATIO_SOURCES", "RECIPES", "RECIPE_FIELDS",
           "TASK_DEFAULTS", "AuditSettings", "Config", "Correction", "CpuFp16", "Dtype",
           "RatioSource", "Recipe", "SamplingArgs", "ShadowKernels", "check_fields",
           "check_value", "coerce", "dump_yaml", "engine_needs", "field_specs", "load_yaml",
           "make_config", "own", "quoted", "recipe", "shared"]
