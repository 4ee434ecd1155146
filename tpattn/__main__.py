from .cli import main
from .dist import exit_now

exit_now(main())  # without the interpreter's finalization: see exit_now
