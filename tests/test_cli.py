"""`vlm-catalog`: one parser per command, its module imported only when that command runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vlm_catalog.cli import COMMANDS, main


def test_the_command_list_imports_no_command_module():
    """`vlm-catalog --help` imported every command's module before: 1.6 s, and a traceback where one of
    them could not be imported (the service's httpx, in an install without it)."""
    script = (
        "import sys\n"
        "from vlm_catalog.cli import COMMANDS, main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as stop:\n    assert stop.code == 0\n"
        "print(sorted(c.module for c in COMMANDS.values() if c.module in sys.modules), 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    listing, imported = result.stdout.rsplit("\n", 2)[0], result.stdout.splitlines()[-1]
    assert imported == "[] False"
    for name, command in COMMANDS.items():
        assert name in listing and command.summary.split()[0] in listing


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_command_parses_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as stop:
        main([name, "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: vlm-catalog {name} ")
