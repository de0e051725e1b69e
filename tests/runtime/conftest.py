"""Fixtures of the runtime tests: generation's tiny models."""

from tests.generation.conftest import model  # pylint: disable=unused-import
from tests.generation.conftest import text_model  # pylint: disable=unused-import
from tests.generation.conftest import tok  # pylint: disable=unused-import
