"""Settings for the whole test session."""

from __future__ import annotations

import signal

# Tests press Ctrl-C on the processes they start (SIGINT). A shell that runs the suite in
# the background (`.ci/run &`) starts it with SIGINT ignored, and every child would inherit
# that and never see the key. A handler, unlike "ignored", is reset to the default in a
# child at exec, so the processes under test get Ctrl-C as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
