"""Foundation: what every layer stands on (torch-free): installed versions, signature drift,
the function behind a wrapper, and where a moved module of the engine went (``engine.foundation.moved``)."""
