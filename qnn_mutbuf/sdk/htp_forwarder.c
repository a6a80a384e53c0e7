/*
 * Forwarding libQnnHtp.so for QAIRT >= 2.47 host libraries.
 *
 * ExecuTorch 1.5.1 was built with QNN headers in which an HTP device custom
 * config is {u32 option; union at byte 4}. QAIRT 2.47 and newer read that
 * union at byte 8, so the SoC model reads as 0 and deviceCreate fails with
 * "unknown custom config socModel 0" (error 14001). This library stands in
 * for libQnnHtp.so (same soname), loads the real library that sits beside it
 * as libQnnHtp.real.so, and rewrites each device custom config into the new
 * layout before calling the real deviceCreate. Everything else is the real
 * library's own code: the provider table is patched in place, slot by slot.
 *
 * The declarations below are written from the ABI facts only:
 *   provider  = {u32 backendId; const char* name; u32 core[3]; u32 backend[3];
 *                function table...}, deviceCreate is table slot 40.
 *   device config = {u32 option; union{pointer}}, option 0 = custom.
 *   HTP device custom config: old {u32 option; u32 a; u32 b},
 *                             new {u32 option; u32 pad; u32 a; u32 b}.
 * Set QNN_MUTBUF_FORWARDER_LOG=1 to log each rewritten config on stderr.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef uint64_t qnn_error_t;
typedef qnn_error_t (*get_providers_fn)(const void*** providers, uint32_t* count);
typedef qnn_error_t (*device_create_fn)(void* logger, const void** configs, void** device);

#define FUNCTION_TABLE_OFFSET 40
#define DEVICE_CREATE_SLOT 40
#define DEVICE_CONFIG_OPTION_CUSTOM 0u
#define MAX_PROVIDERS 4
#define NEW_CUSTOM_CONFIG_BYTES 64 /* generous: the new union may be wider */

struct device_config {
    uint32_t option;
    uint32_t reserved;
    const void* custom; /* the union's pointer member, 8-byte aligned */
};

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static void* real_library = NULL;
static get_providers_fn real_get_providers = NULL;
static char load_error[PATH_MAX + 512];
static int log_enabled = 0;

static pthread_mutex_t patch_lock = PTHREAD_MUTEX_INITIALIZER;
static device_create_fn original_device_create[MAX_PROVIDERS];
static int patched_count = 0;

static void log_line(const char* format, uint32_t a, uint32_t b, uint32_t c) {
    if (log_enabled) {
        fprintf(stderr, "[qnn_mutbuf forwarder] ");
        fprintf(stderr, format, a, b, c);
        fputc('\n', stderr);
    }
}

static void load_real_library(void) {
    Dl_info self;
    char path[PATH_MAX];
    const char* flag = getenv("QNN_MUTBUF_FORWARDER_LOG");
    log_enabled = flag != NULL && flag[0] != '\0' && flag[0] != '0';
    if (dladdr((void*)&load_real_library, &self) == 0 || self.dli_fname == NULL) {
        snprintf(load_error, sizeof load_error, "cannot locate the forwarder itself");
        return;
    }
    snprintf(path, sizeof path, "%s", self.dli_fname);
    char* slash = strrchr(path, '/');
    if (slash == NULL) {
        snprintf(load_error, sizeof load_error, "forwarder loaded without a path: %s", path);
        return;
    }
    snprintf(slash + 1, sizeof path - (size_t)(slash + 1 - path), "libQnnHtp.real.so");
    real_library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (real_library == NULL) {
        snprintf(load_error, sizeof load_error, "cannot load %s: %s", path, dlerror());
        return;
    }
    real_get_providers = (get_providers_fn)dlsym(real_library, "QnnInterface_getProviders");
    if (real_get_providers == NULL) {
        snprintf(load_error, sizeof load_error, "%s has no QnnInterface_getProviders", path);
    }
}

/* Copies an old-layout HTP device custom config into the new layout. The
 * payload (two u32 words after the option) moves from byte 4 to byte 8. */
static void* convert_custom_config(const void* old_config) {
    const uint32_t* old_words = (const uint32_t*)old_config;
    uint32_t* new_words = (uint32_t*)calloc(1, NEW_CUSTOM_CONFIG_BYTES);
    if (new_words == NULL) return NULL;
    new_words[0] = old_words[0];
    new_words[2] = old_words[1];
    new_words[3] = old_words[2];
    log_line("device custom config option %u: payload (%u, %u) moved to byte 8",
             old_words[0], old_words[1], old_words[2]);
    return new_words;
}

static qnn_error_t create_device_with(int provider, void* logger, const void** configs,
                                      void** device) {
    device_create_fn original = original_device_create[provider];
    size_t count = 0;
    while (configs != NULL && configs[count] != NULL) count++;
    if (count == 0) return original(logger, configs, device);

    const void** rewritten = (const void**)calloc(count + 1, sizeof(void*));
    struct device_config* copies = (struct device_config*)calloc(count, sizeof *copies);
    void** custom_copies = (void**)calloc(count, sizeof(void*));
    qnn_error_t result;
    if (rewritten == NULL || copies == NULL || custom_copies == NULL) {
        free(rewritten);
        free(copies);
        free(custom_copies);
        return original(logger, configs, device);
    }
    for (size_t i = 0; i < count; i++) {
        const struct device_config* config = (const struct device_config*)configs[i];
        rewritten[i] = config;
        if (config->option != DEVICE_CONFIG_OPTION_CUSTOM || config->custom == NULL) continue;
        custom_copies[i] = convert_custom_config(config->custom);
        if (custom_copies[i] == NULL) continue;
        copies[i] = *config;
        copies[i].custom = custom_copies[i];
        rewritten[i] = &copies[i];
    }
    result = original(logger, rewritten, device);
    for (size_t i = 0; i < count; i++) free(custom_copies[i]);
    free(custom_copies);
    free(copies);
    free(rewritten);
    return result;
}

#define DEFINE_DEVICE_CREATE(index)                                                    \
    static qnn_error_t device_create_##index(void* logger, const void** configs,       \
                                             void** device) {                          \
        return create_device_with(index, logger, configs, device);                    \
    }
DEFINE_DEVICE_CREATE(0)
DEFINE_DEVICE_CREATE(1)
DEFINE_DEVICE_CREATE(2)
DEFINE_DEVICE_CREATE(3)
static const device_create_fn device_create_wrappers[MAX_PROVIDERS] = {
    device_create_0, device_create_1, device_create_2, device_create_3};

static int is_wrapper(device_create_fn function) {
    for (int i = 0; i < MAX_PROVIDERS; i++)
        if (device_create_wrappers[i] == function) return 1;
    return 0;
}

/* Reads the protection of the mapping that holds `address` from
 * /proc/self/maps, so that a patched page gets its own protection back. */
static int page_protection(uintptr_t address) {
    FILE* maps = fopen("/proc/self/maps", "r");
    char line[512];
    int protection = -1;
    if (maps == NULL) return -1;
    while (fgets(line, sizeof line, maps) != NULL) {
        unsigned long low, high;
        char perms[5];
        if (sscanf(line, "%lx-%lx %4s", &low, &high, perms) != 3) continue;
        if (address < low || address >= high) continue;
        protection = (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) |
                     (perms[2] == 'x' ? PROT_EXEC : 0);
        break;
    }
    fclose(maps);
    return protection;
}

/* Writes one function-table slot of a provider that may live in the real
 * library's read-only data, restoring the page protection afterwards. */
static int write_slot(void** slot, void* value) {
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)slot & ~((uintptr_t)page - 1);
    int protection = page_protection((uintptr_t)slot);
    if (protection < 0) return -1;
    if (protection & PROT_WRITE) {
        *slot = value;
        return 0;
    }
    if (mprotect((void*)start, (size_t)page, protection | PROT_WRITE) != 0) return -1;
    *slot = value;
    mprotect((void*)start, (size_t)page, protection);
    return 0;
}

static void patch_provider(const void* provider) {
    void** slot = (void**)((char*)provider + FUNCTION_TABLE_OFFSET) + DEVICE_CREATE_SLOT;
    device_create_fn current = (device_create_fn)*slot;
    if (current == NULL || is_wrapper(current)) return;
    if (patched_count >= MAX_PROVIDERS) return;
    original_device_create[patched_count] = current;
    if (write_slot(slot, (void*)device_create_wrappers[patched_count]) == 0) {
        log_line("provider backend %u: deviceCreate wrapped (slot %u, index %u)",
                 *(const uint32_t*)provider, DEVICE_CREATE_SLOT, (uint32_t)patched_count);
        patched_count++;
    }
}

__attribute__((visibility("default"))) qnn_error_t QnnInterface_getProviders(
    const void*** providers, uint32_t* count) {
    pthread_once(&load_once, load_real_library);
    if (real_get_providers == NULL) {
        fprintf(stderr, "[qnn_mutbuf forwarder] %s\n", load_error);
        return 1; /* any non-zero value is an error to QNN callers */
    }
    qnn_error_t result = real_get_providers(providers, count);
    if (result != 0 || providers == NULL || *providers == NULL || count == NULL) return result;
    pthread_mutex_lock(&patch_lock);
    for (uint32_t i = 0; i < *count; i++) patch_provider((*providers)[i]);
    pthread_mutex_unlock(&patch_lock);
    return result;
}

/* Lets Python confirm that the loaded libQnnHtp.so is this forwarder. */
__attribute__((visibility("default"))) const char* QnnMutbufForwarder_version(void) {
    return "qnn_mutbuf-htp-forwarder-1";
}
