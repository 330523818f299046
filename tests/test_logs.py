"""capsnet.logs: the library's lines go through the "capsnet" logger, shown as the command line shows them
(information on stdout, warnings on stderr, the message alone), and a user silences or redirects them as usual."""

import logging

import pytest

from capsnet.logs import LOGGER


@pytest.fixture
def level():
    old = LOGGER.level
    yield
    LOGGER.setLevel(old)


def test_information_goes_to_stdout_and_warnings_to_stderr_as_printed(capsys):
    LOGGER.info("epoch 1/2  train loss 0.5")
    logging.getLogger("capsnet.training.loop").warning("capsnet: a warning")  # a module's child logger
    out, err = capsys.readouterr()
    assert out == "epoch 1/2  train loss 0.5\n" and err == "capsnet: a warning\n"


def test_a_user_silences_the_lines_the_usual_way(capsys, level):
    logging.getLogger("capsnet").setLevel(logging.WARNING)
    LOGGER.info("hidden")
    LOGGER.warning("shown")
    assert capsys.readouterr() == ("", "shown\n")
