"""``fsdp2_compat.core.config``: the selection grammar and both activation policies."""

import pytest

from fsdp2_compat import registry
from fsdp2_compat.core import config

# The releases this module's outcome depends on: .ci/test runs it once per distinct set of them (.ci/matrix.py).
DEPENDS_ON = ("python",)

NAMES = registry.names()


@pytest.mark.parametrize(
    "text, expected",
    [
        (None, NAMES),
        ("", NAMES),
        ("all", NAMES),
        ("none", ()),
        ("OFF", ()),
        (" GLM4V , ", ("glm4v",)),
        ("-glm4v", tuple(n for n in NAMES if n != "glm4v")),
        ("glm4v,voxtral,-voxtral", ("glm4v",)),
        ("voxtral,glm4v", ("glm4v", "voxtral")),  # registry order, whatever the order written
    ],
)
def test_selection_grammar(text, expected):
    assert config.parse_selection(text, NAMES) == expected


@pytest.mark.parametrize("text", ["glm4", "glm4v,qwen9", "none,glm4v", "-all"])
def test_bad_selection_is_rejected_naming_the_token_and_the_valid_names(text):
    with pytest.raises(config.ConfigError) as info:
        config.parse_selection(text, NAMES)
    message = str(info.value)
    assert config.PATCHES_ENV in message
    if "unknown" in message:
        bad = [t.strip() for t in text.split(",") if t.strip() not in NAMES][0]
        assert repr(bad) in message and "glm4v" in message


@pytest.mark.parametrize("value, explicit, implicit", [
    (None, None, None),            # explicit: all; implicit: nothing
    ("", "", None),
    ("  ", "  ", None),
    (" glm4v ", " glm4v ", "glm4v"),
])
def test_the_two_activation_policies(value, explicit, implicit):
    environ = {} if value is None else {config.PATCHES_ENV: value}
    assert config.explicit_selection(environ) == explicit
    assert config.implicit_selection(environ) == implicit
    # What each policy then requests: explicit unset/blank means every patch.
    assert config.parse_selection(config.explicit_selection(environ), NAMES) == (NAMES if not (value or "").strip() else ("glm4v",))


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" Yes ", True), ("on", True),
                                       ("0", False), ("", False), ("no", False), (None, False)])
def test_one_truthiness_rule_for_switches(value, on):
    environ = {} if value is None else {config.STRICT_ENV: value, config.DISABLE_BOOTSTRAP_ENV: value}
    assert config.strict_from_env(environ) is on
    assert config.bootstrap_disabled(environ) is on


def test_the_pth_line_reads_the_same_variable_and_imports_the_bootstrap():
    line = config.PTH_LINE
    assert "\n" not in line and line.startswith("import ")
    assert 'os.environ.get("%s", "")' % config.PATCHES_ENV in line
    assert "import %s as b; b.startup()" % config.BOOTSTRAP_MODULE in line
    compile(line, config.PTH_NAME, "exec")  # site.py executes it


def test_unknown_name_in_the_environment_fails_at_startup(python):
    proc = python("import fsdp2_compat.auto", env={"FSDP2_COMPAT_PATCHES": "glm4v,glm5v"}, check=False)
    assert proc.returncode != 0
    assert "unknown patch 'glm5v'" in proc.stderr and "glm4v" in proc.stderr


def test_import_loads_no_heavy_module(python):
    proc = python(
        """
        import sys
        import fsdp2_compat, fsdp2_compat.auto
        heavy = ("torch", "transformers", "verl", "skyrl", "skyrl_train", "trl", "accelerate", "areal",
                 "llamafactory", "wrapt", "packaging", "importlib.metadata", "logging", "inspect")
        print(sorted(m for m in sys.modules if m.split(".")[0] in heavy or m in heavy))
        """
    )
    assert proc.stdout.strip() == "[]"
