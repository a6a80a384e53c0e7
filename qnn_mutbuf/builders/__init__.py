"""QNN node visitors that give mutable buffers their state encoding.

Importing this package registers them in ExecuTorch's QNN builder registry,
replacing upstream's visitors for the same targets; lowering imports it.
"""

import executorch.backends.qualcomm.builders  # noqa: F401  (upstream visitors first)

from qnn_mutbuf.builders.op_clamp import register_bounded_clamp_visitors
from qnn_mutbuf.builders.op_index_put import register_state_index_put_visitor
from qnn_mutbuf.builders.op_to import register_integer_cast_visitors
from qnn_mutbuf.builders.state_write import register_state_write_visitors

register_state_index_put_visitor()
register_integer_cast_visitors()
register_bounded_clamp_visitors()  # before: the state-write wrappers wrap these
register_state_write_visitors()
