def init(
    msg_init: int | None,
    msg_recv: int | None,
    msg_data: int | None,
    msg_size: int | None,
    msg_more: int | None,
    msg_close: int | None,
    errno: int | None,
    /,
) -> None: ...
def recv(socket_handle: int, /) -> list[bytes] | None: ...
