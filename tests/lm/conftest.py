"""Fixtures of the LM tests."""

import pytest


@pytest.fixture
def cli_error(capsys):
    """The function `(main, argv) -> str`: runs a CLI's `main(argv)`, which must exit non-zero with exactly one
    `error: ...` line on stderr, and returns that line."""

    def run(main, argv: list[str]) -> str:
        capsys.readouterr()  # drop what earlier steps of the test printed
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code not in (0, None)
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
        return lines[0]

    return run
