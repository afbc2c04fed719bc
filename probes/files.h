/* Which file an fd, or a process's executable, is: (device, inode) and the dentry names up to its filesystem's
 * root, read in BPF so that user space can name and open the file after the process has exited.
 *
 * Every struct member is reached through an offset from the running kernel's BTF (tracer/recorder/btf.py FILE_OFFSETS,
 * passed as -D flags by tracer/recorder/program.py): the installed headers belong to another kernel.
 */
#ifndef CHT_FILES_H
#define CHT_FILES_H

#include "common.h"

#if !defined(OFF_TASK_FILES) || !defined(OFF_DENTRY_PARENT)
#error "files.h needs the -DOFF_* flags of tracer.recorder.program.cflags()"
#endif

static __always_inline u64 kread_ptr(u64 addr)
{
    u64 v = 0;
    if (addr)
        bpf_probe_read_kernel(&v, sizeof(v), (void *)addr);
    return v;
}

/* struct file * of the current task's fd, or 0. */
static __always_inline u64 fd_file(int fd)
{
    if (fd < 0)
        return 0;
    u64 task = bpf_get_current_task();
    u64 files = kread_ptr(task + OFF_TASK_FILES);
    u64 fdt = kread_ptr(files + OFF_FILES_FDT);
    if (!fdt)
        return 0;
    u32 max = 0;
    bpf_probe_read_kernel(&max, sizeof(max), (void *)(fdt + OFF_FDT_MAX_FDS));
    if ((u32)fd >= max)
        return 0;
    u64 fds = kread_ptr(fdt + OFF_FDT_FD);
    return kread_ptr(fds + (u64)fd * 8);
}

/* (dev, ino) of a struct file; 0 on failure. dev is the kernel's dev_t (major << 20 | minor). */
static __always_inline int file_id(u64 file, u32 *dev, u64 *ino)
{
    u64 inode = kread_ptr(file + OFF_FILE_INODE);
    if (!inode)
        return -1;
    bpf_probe_read_kernel(ino, sizeof(*ino), (void *)(inode + OFF_INODE_INO));
    u64 sb = kread_ptr(inode + OFF_INODE_SB);
    bpf_probe_read_kernel(dev, sizeof(*dev), (void *)(sb + OFF_SB_DEV));
    return 0;
}

/* The dentry names of a struct file into e->names, the file first, up to the filesystem root (excluded); sets
 * e->depth. A deeper path is cut: user space then finds the file by (dev, ino) from the process's maps. */
static __always_inline void file_names(u64 file, struct map_event *e)
{
    u64 dentry = kread_ptr(file + OFF_FILE_PATH + OFF_PATH_DENTRY);
    u16 depth = 0;
    for (int i = 0; i < PATH_DEPTH; i++) {
        if (!dentry)
            break;
        u64 parent = kread_ptr(dentry + OFF_DENTRY_PARENT);
        if (parent == dentry)
            break; /* the root of this filesystem */
        u64 name = kread_ptr(dentry + OFF_DENTRY_NAME + OFF_QSTR_NAME);
        bpf_probe_read_kernel_str(e->names + i * PATH_NAME, PATH_NAME, (void *)name);
        depth++;
        dentry = parent;
    }
    e->depth = depth;
}

#endif /* CHT_FILES_H */
